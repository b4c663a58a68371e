"""TraceModule's training step: the log-probs it trains on, the statistics it logs, NaN safety,
and compiled decoder layers. A tiny random-weight Qwen3 and synthetic token sequences (the math
does not depend on what the tokens say)."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

from trace_lightning.math.loss import policy_loss, token_logprobs
from trace_lightning.models import tiny_qwen3_config
from trace_lightning.training.module import TraceModule, compile_decoder_layers
from trace_lightning.packing.leaves import collate
from trace_lightning.tree import RolloutTree
from builders.training import minibatch
from builders.trees import TINY_VOCAB, mixed_trees, random_leaf


def load(policy_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).train()


def test_logprobs_of_right_padded_batch_equal_each_sequence_alone(policy_dir, monkeypatch):
    """Without an attention mask, every policy token of a right-padded micro-batch gets the
    log-prob (and entropy) it gets alone; every other position is 0, and the LM head saw
    only the rows that predict policy tokens. Attention runs as plain causal SDPA (the
    flash-eligible call: no mask tensor)."""
    rng = random.Random(0)
    seqs = [random_leaf(rng, n, 3, i) for i, n in enumerate((12, 7, 4))]
    mb = collate(seqs, pad_id=0)
    assert (mb["attention_mask"] == 0).any()  # padding to get wrong
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    policy = load(policy_dir)
    head_rows = []
    policy.lm_head.register_forward_hook(lambda m, args, out: head_rows.append(out.shape[0]))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    logp, ent = TraceModule._logprobs(policy, mb, with_entropy=True)  # (B, T) each
    monkeypatch.undo()
    assert calls and all(mask is None and causal for mask, causal in calls)
    n_policy = int(mb["policy_mask"].sum())
    assert head_rows == [n_policy] and n_policy < mb["attention_mask"].sum()
    pm = mb["policy_mask"].bool()
    assert not logp[~pm].any() and not ent[~pm].any()
    policy.lm_head._forward_hooks.clear()
    for i, s in enumerate(seqs):
        ids = torch.tensor([s.input_ids])
        want, want_ent = token_logprobs(policy(input_ids=ids).logits, ids, with_entropy=True)
        n = len(s.input_ids)
        m = pm[i, :n]
        assert m.any()
        torch.testing.assert_close(logp[i, :n][m], want[0][m], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[i, :n][m], want_ent[0][m], rtol=1e-5, atol=1e-5)


def test_logprobs_gradients_equal_the_full_head(policy_dir):
    """A loss over policy tokens has the same gradient for every parameter whether the LM
    head ran on all rows or on the policy rows only; a micro-batch without policy tokens
    (the all-masked filler that keeps ranks in step) still backpropagates, with zero
    gradients."""
    rng = random.Random(4)
    mb = collate([random_leaf(rng, n, 3, i) for i, n in enumerate((13, 8, 5))], pad_id=0)
    up = torch.randn(mb["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for rows_only in (False, True):
        policy = load(policy_dir)
        if rows_only:
            logp, _ = TraceModule._logprobs(policy, mb)
        else:
            logp, _ = token_logprobs(policy(input_ids=mb["input_ids"]).logits, mb["input_ids"])
        (logp * up * mb["policy_mask"]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6,
                                   msg=name)
    empty = dict(mb, policy_mask=torch.zeros_like(mb["policy_mask"]))
    policy = load(policy_dir)
    logp, _ = TraceModule._logprobs(policy, empty)
    assert not logp.any()
    (logp * up).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in policy.parameters())


def _fit(module: TraceModule, batches: list[dict], callbacks=(), **kw) -> L.Trainer:
    """One epoch of a real Trainer over ``batches`` (one mini-batch each)."""
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks), **kw)
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None))
    return trainer


@pytest.mark.parametrize("dual_clip", [None, 1.05])
def test_training_step_logs_minibatch_statistics(policy_dir, dual_clip):
    """The logged loss is the sum of the micro-batch losses (each normalised by the whole
    mini-batch's policy tokens), statistics are token-weighted means over both micro-batches,
    ratio_max is the largest over both, computed here from the initial policy; with
    --model.dual_clip the loss is the dual-clipped one."""
    batch = minibatch(1)
    policy = load(policy_dir)
    loss_sum, tokens, weighted, ratio_max, entropies = 0.0, 0.0, {}, 0.0, []
    undual = 0.0
    for mb in batch["micro"]:
        logp, ent = token_logprobs(policy(input_ids=mb["input_ids"]).logits, mb["input_ids"],
                                   with_entropy=True)
        loss, stats = policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["policy_mask"],
                                  clip_low=0.2, clip_high=0.28, normalizer=batch["n_tokens"],
                                  entropy=ent, dual_clip=dual_clip)
        undual += policy_loss(logp, mb["old_logprobs"], mb["advantages"], mb["policy_mask"],
                              normalizer=batch["n_tokens"])[0].item()
        w = float(stats["tokens"])
        entropies.append(float(stats["entropy"]))
        loss_sum += loss.item()
        tokens += w
        ratio_max = max(ratio_max, float(stats["ratio_max"]))
        for k in ("approx_kl", "ratio_mean", "entropy", "clip_frac_low", "clip_frac_dual"):
            weighted[k] = weighted.get(k, 0.0) + float(stats[k]) * w
    assert (abs(loss_sum - undual) > 1e-3) == (dual_clip is not None)  # the cap bites here
    trainer = _fit(TraceModule(policy_path=str(policy_dir), lr=1e-3, dual_clip=dual_clip),
                   [batch])
    got = {k: float(v) for k, v in trainer.logged_metrics.items()}
    assert got["train/policy_tokens"] == tokens == batch["n_tokens"]
    assert got["train/loss"] == pytest.approx(loss_sum, rel=1e-4, abs=1e-6)
    assert got["train/ratio_max"] == pytest.approx(ratio_max, rel=1e-5)
    for k, v in weighted.items():
        assert got[f"train/{k}"] == pytest.approx(v / tokens, rel=1e-4, abs=1e-7), k
    # the micro-batches' entropies differ (by 3e-5 relative here): their plain mean is
    # another number than the token-weighted one, told apart at a tighter tolerance
    means = [entropies[i] for i in range(2)]
    plain_mean = sum(means) / 2
    assert abs(plain_mean - weighted["entropy"] / tokens) > 1e-5 * plain_mean
    assert got["train/entropy"] == pytest.approx(weighted["entropy"] / tokens, rel=2e-6)
    # under several ranks the divisor is the mini-batch's tokens over all ranks / ranks
    # (packing.equalise_over_ranks), here as if the other rank held 7 times this one's tokens
    shared = dict(batch, normalizer=(batch["n_tokens"] * 8) / 2)
    trainer = _fit(TraceModule(policy_path=str(policy_dir), lr=1e-3, dual_clip=dual_clip),
                   [shared])
    assert float(trainer.logged_metrics["train/loss"]) == pytest.approx(loss_sum / 4, rel=1e-4)


def test_the_update_recomputes_log_probs_at_the_sampling_temperature(policy_dir):
    """Rollouts sampled at temperature 0.5 carry the engine's log-probs of that distribution
    (log_softmax(logits / 0.5)); the mini-batch says so, and the first pass's importance
    ratios are then exactly 1. Read at temperature 1 they would be far from it."""
    policy = load(policy_dir)
    batch = minibatch(2)
    with torch.no_grad():
        for mb in batch["micro"]:
            mb["old_logprobs"] = TraceModule._logprobs(policy, mb, temperature=0.5)[0]
            at_1 = TraceModule._logprobs(policy, mb)[0]
            pm = mb["policy_mask"].bool()
            assert (at_1 - mb["old_logprobs"])[pm].abs().max() > 0.1
    trainer = _fit(TraceModule(policy_path=str(policy_dir), lr=1e-3),
                   [dict(batch, temperature=0.5)])
    got = {k: float(v) for k, v in trainer.logged_metrics.items()}
    assert got["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert got["train/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert got["train/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    trainer = _fit(TraceModule(policy_path=str(policy_dir), lr=1e-3), [batch])  # read at 1
    assert abs(float(trainer.logged_metrics["train/ratio_mean"]) - 1.0) > 0.05


def test_kl_to_the_reference_is_zero_until_the_policy_moves(policy_dir):
    """With kl_coef > 0 a frozen copy of the initial policy scores the same rows: the k3 KL
    is exactly 0 on the first mini-batch and positive once an update has moved the policy."""
    kl = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kl.append(float(trainer.callback_metrics["train/kl_ref"]))

    _fit(TraceModule(policy_path=str(policy_dir), lr=1e-2, kl_coef=0.1),
         [minibatch(1), minibatch(3)], callbacks=[Record()])
    assert kl[0] == 0.0 and kl[1] > 1e-6


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gradient_norm_is_clipped_in_true_units_under_a_loss_scaler(policy_dir):
    """16-mixed with a GradScaler (what Lightning sets up on GPU; built here by hand on CPU,
    where it sets none): the logged norm is the unscaled gradient's, not 1024 times it, and
    the clip leaves the update an unscaled, clipped step of plain SGD would."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    batch = minibatch(4)

    def run(**kw):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-2, max_grad_norm=0.5)
        module.configure_optimizers = lambda: torch.optim.SGD(module.policy.parameters(),
                                                              lr=1e-2)
        trainer = _fit(module, [batch], **kw)
        return float(trainer.logged_metrics["train/grad_norm"]), module

    plain_norm, plain = run()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaled_norm, scaled = run(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert plain_norm > 0.5  # the clip acts
    assert scaled_norm == pytest.approx(plain_norm, rel=0.05)  # fp16 autocast, true units
    for (name, p), q in zip(plain.policy.named_parameters(), scaled.policy.parameters()):
        torch.testing.assert_close(q, p, atol=2e-4, rtol=0, msg=name)


def test_gradient_norm_is_logged_without_clipping(policy_dir):
    """max_grad_norm 0 measures the norm without clipping: the same first-step norm as a
    clipped run (measured before the clip), not NaN."""
    def first_norm(max_grad_norm):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-3, max_grad_norm=max_grad_norm)
        return float(_fit(module, [minibatch(5)]).logged_metrics["train/grad_norm"])

    clipped, measured = first_norm(1e-3), first_norm(0.0)
    assert clipped > 1e-3 and measured == pytest.approx(clipped, rel=1e-5)


def test_a_mini_batch_without_policy_tokens_does_not_move_the_weights(policy_dir):
    """A step with fewer leaves than mini-batches leaves filler-only mini-batches: Adam's
    moments and weight decay would still move every weight, and the lr schedule advance."""
    from trace_lightning.packing.leaves import equalise_over_ranks

    real = minibatch(6)
    filler = equalise_over_ranks([real, {"micro": [], "n_tokens": 0.0}], pad_id=0)[1]
    assert filler["n_tokens"] == 0.0 and filler["micro"]  # filler micro-batches, no tokens
    snapshots, lrs = [], []

    class Snap(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append([p.detach().clone() for p in pl_module.policy.parameters()])
            lrs.append(float(trainer.callback_metrics["train/lr"]))

    module = TraceModule(policy_path=str(policy_dir), lr=1e-3, weight_decay=0.1,
                         lr_warmup_steps=4)
    trainer = _fit(module, [real, filler, filler], callbacks=[Snap()])
    for before, after in zip(snapshots[0], snapshots[2]):
        assert torch.equal(before, after)
    assert lrs == pytest.approx([2.5e-4, 5e-4, 5e-4])  # the schedule waits too
    assert trainer.global_step == 1


def test_a_normalizer_below_one_divides_the_loss(policy_dir):
    """A mini-batch with fewer policy tokens over all ranks than ranks has a normalizer
    below 1 (equalise_over_ranks: tokens / ranks); the loss is divided by it as given, so
    after the ranks' gradient mean it is the token mean, as on one process."""
    def first_loss(normalizer):
        module = TraceModule(policy_path=str(policy_dir), lr=1e-3)
        trainer = _fit(module, [{**minibatch(7), "normalizer": normalizer}])
        return float(trainer.logged_metrics["train/loss"])

    assert first_loss(0.5) == pytest.approx(2 * first_loss(1.0), rel=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_predictor_trains_in_float32_under_any_precision(policy_dir, precision):
    """The predictor's fit steps its own optimizer, not through the precision plugin: under
    16-mixed a GradScaler would unscale gradients it never scaled (an error before the first
    scaled backward); under bf16-true the predictor would be cast to bf16 and refuse the
    float32 features. Under 16-mixed it learns exactly as under 32-true."""
    import types

    from lightning.pytorch.plugins.precision import MixedPrecision


    stats = {}

    class Receive(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.receive_step(types.SimpleNamespace(trees=mixed_trees(), epoch=0))
            pl_module.fit_predictor()
            stats[trainer.precision] = dict(pl_module.predictor_life.stats)
            assert all(p.dtype == torch.float32 for p in pl_module.predictor.parameters())

    kw = ({"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
          if precision == "16-mixed" else {"precision": precision})
    _fit(TraceModule(policy_path=str(policy_dir), lr=1e-4), [minibatch(1)],
         callbacks=[Receive()], **kw)
    assert stats[precision]["predictor/updates"] > 0
    if precision == "16-mixed":
        _fit(TraceModule(policy_path=str(policy_dir), lr=1e-4), [minibatch(1)],
             callbacks=[Receive()])
        assert stats[precision] == pytest.approx(stats["32-true"])


def _tree_batches(trees: list[RolloutTree], n_minibatches: int) -> list[dict]:
    """The DataModule's tree-packed mini-batches of ``trees`` (GRPO advantages)."""
    import copy

    from trace_lightning.math.advantage import assign_advantages
    from trace_lightning.packing.trees import tree_minibatches, update_units

    trees = copy.deepcopy(trees)
    units = []
    for t in trees:
        seqs = t.flatten()
        for seq, adv in zip(seqs, assign_advantages(seqs, [t], "grpo")):
            seq.token_advantages = adv
        units.append(update_units(t, seqs, 4096))
    return tree_minibatches(units, n_minibatches, 4096, pad_id=0, seed=0)


def _with_continuations(trees: list[RolloutTree]) -> list[RolloutTree]:
    """One continuation from each tree's first turn of rollout 0 (in place)."""
    for t in trees:
        first = t.root.children[0]
        t.add_child(first, token_ids=[10, 11], logprobs=[-1.0, -1.0], policy_mask=[1, 1],
                    finished=True, reward=1.0)
        t.compute_values()
    return trees


def _path_features(policy, trees: list[RolloutTree]) -> dict:
    """Every node's feature the plain way: its prefix alone, a causal forward, the last
    hidden state (the packed readings' reference)."""
    from trace_lightning.allocation.features import prompt_features

    keys = [(t.tree_id, n.id) for t in trees for n in t.nodes]
    paths = [t.prefix_ids(n.id) for t in trees for n in t.nodes]
    return dict(zip(keys, prompt_features(policy, paths, batch_tokens=4096)))


def test_the_step_features_are_computed_once(policy_dir, monkeypatch):
    """The rollout's predictions featurise stage 1's roots, then stage 2's trees (one packed
    unit each, its two bare rollouts); the predictor learns after the update's last
    mini-batch, and the features it lacks (the continuations') come from the update's own
    forward: no further policy forward runs for it. Its features equal a fresh computation
    at the weights the update started from (one mini-batch: the forward came before the
    optimizer step)."""
    import types

    from trace_lightning.allocation import features
    from trace_lightning.training import predictor_life as module_lib

    ran: list[list[int]] = []  # every prompt or tree unit the policy featurised
    last_hidden_at, layout = features._last_hidden_at, features.layout

    def spy(policy, sequences, positions, batch_tokens):
        ran.extend(sequences)
        return last_hidden_at(policy, sequences, positions, batch_tokens)

    def spy_layout(tree, ends):
        unit = layout(tree, ends)
        ran.append(unit.input_ids.tolist())
        return unit

    monkeypatch.setattr(features, "_last_hidden_at", spy)
    monkeypatch.setattr(features, "layout", spy_layout)
    seen = {}
    training_batch = module_lib.training_batch

    def keep(trees, feats, *args, **kwargs):  # the features the predictor fits on
        seen["fitted"] = dict(feats)
        seen["ran_by_fit"] = len(ran)
        return training_batch(trees, feats, *args, **kwargs)

    monkeypatch.setattr(module_lib, "training_batch", keep)
    trees = mixed_trees()  # 6 trees x 2 bare rollouts of two turns
    batches = _tree_batches(_with_continuations(mixed_trees()), 1)

    class Rollout(L.Callback):
        def on_train_start(self, trainer, pl_module):
            roots = [RolloutTree.new(t.tree_id, "q", ["a"], t.root.token_ids) for t in trees]
            pl_module.predict_trees(roots)  # stage 1: 6 prompts
            pl_module.predict_trees(trees)  # stage 2: 6 trees (roots known, not read again)
            seen["predicted"] = len(ran)
            _with_continuations(trees)
            seen["fresh"] = _path_features(pl_module.policy, trees)
            del ran[:]
            pl_module.receive_step(types.SimpleNamespace(trees=trees, epoch=0))
            assert "fitted" not in seen  # not before the update

    _fit(TraceModule(policy_path=str(policy_dir), lr=1e-2), batches, callbacks=[Rollout()])
    assert seen["predicted"] == 6 + 6
    assert seen["ran_by_fit"] == 0  # the update's forward read every continuation
    assert seen["fitted"].keys() == seen["fresh"].keys()
    for k, f in seen["fresh"].items():
        torch.testing.assert_close(seen["fitted"][k], f, rtol=1e-4, atol=1e-5)


def test_the_predictor_learns_after_the_steps_last_minibatch(policy_dir):
    """With two mini-batches the predictor has learnt nothing after the first and the step's
    nodes after the second (the step's last); the continuations of the second
    mini-batch's trees are read at the weights its optimizer step started from, which the
    first moved (lr 1e-2), so they differ from the rollout's weights' features."""
    import types

    from trace_lightning.training import predictor_life as module_lib

    trees = mixed_trees()
    batches = _tree_batches(_with_continuations(mixed_trees()), 2)
    second = {k for k in batches[1]["micro"][0]["node_keys"]}
    seen, fitted = {"nodes": []}, {}
    training_batch = module_lib.training_batch

    class Rollout(L.Callback):
        def on_train_start(self, trainer, pl_module):
            pl_module.predict_trees(trees)
            _with_continuations(trees)
            seen["fresh"] = _path_features(pl_module.policy, trees)
            pl_module.receive_step(types.SimpleNamespace(trees=trees, epoch=0))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1:  # the weights the second mini-batch's forward runs at
                seen["moved"] = _path_features(pl_module.policy, trees)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen["nodes"].append(pl_module.predictor_nodes_seen)

    def keep(trees, feats, *args, **kwargs):
        fitted.update(feats)
        return training_batch(trees, feats, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(module_lib, "training_batch", keep)
    try:
        _fit(TraceModule(policy_path=str(policy_dir), lr=1e-2), batches,
             callbacks=[Rollout()])
    finally:
        mp.undo()
    assert seen["nodes"] == [0, len(training_batch(trees, seen["fresh"]).value)]
    continuations = {(t.tree_id, t.nodes[-1].id) for t in trees}
    late = continuations & second
    assert late and continuations - second  # continuations in both mini-batches
    for k in late:
        torch.testing.assert_close(fitted[k], seen["moved"][k], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(fitted[k], seen["fresh"][k], rtol=1e-4, atol=1e-5)
    for k in continuations - second:
        torch.testing.assert_close(fitted[k], seen["fresh"][k], rtol=1e-4, atol=1e-5)


def test_the_policy_trains_without_dropout(tmp_path):
    """A checkpoint saved with attention dropout: in train mode its log-probs would vary
    from pass to pass (and from the sampler's) before any update; the module turns it off."""
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(TINY_VOCAB)
    cfg.attention_dropout = 0.5
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    module = TraceModule(policy_path=str(tmp_path))
    module.configure_model()
    assert module.policy.training and module.policy.config.attention_dropout == 0.0
    ids = torch.randint(1, TINY_VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    first, second = (module.policy(input_ids=ids).logits for _ in range(2))
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nan_advantage_stops_before_the_optimizer_step(policy_dir):
    """A NaN in one micro-batch raises a clear error and leaves every weight unchanged."""
    batch = minibatch(2, advantage_nan=True)
    module = TraceModule(policy_path=str(policy_dir), lr=1e-3)
    before = {n: p.detach().clone() for n, p in load(policy_dir).named_parameters()}
    with pytest.raises(FloatingPointError, match="step was not applied"):
        _fit(module, [batch])
    for name, p in module.policy.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        assert p.grad is None, name


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_same_logprobs_and_gradients(policy_dir):
    """``compile_layers``: each Qwen3DecoderLayer compiled in place; forward and backward of
    a right-padded micro-batch agree with the eager model."""
    mb = collate([random_leaf(random.Random(3), n, 3, i) for i, n in enumerate((10, 6))], pad_id=0)
    results = []
    for compiled in (False, True):
        policy = load(policy_dir)
        if compiled:
            assert compile_decoder_layers(policy) == policy.config.num_hidden_layers
        logp, _ = TraceModule._logprobs(policy, mb)
        (logp * mb["policy_mask"]).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-4, atol=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-3, atol=1e-5, msg=name)


def test_compile_layers_names_the_flag_when_a_model_has_no_layer_class():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="--model.compile_layers"):
        compile_decoder_layers(model)
