"""Rollout correction: the sampler/trainer mismatch and its truncated and masked importance
weights (``trace_lightning.math.rollout_correction``, ``training.rollout_correction``).

Hand-derived weights for every mode; a packed tree's corrected update equals the per-leaf one
(sequence-level weights differ per leaf through a shared token); a real mismatch (sampled by
a policy whose weights differ from the trainer's) raises the logged mismatch, and the
correction bounds the weights; the later mini-batches' start log-probs are the step's start
weights'. A tiny random-weight Qwen3.
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from trace_lightning.math.loss import weighted_policy_loss
from trace_lightning.math.rollout_correction import (correction_weights, fold_pair_weights,
                                                     mismatch_stats)
from trace_lightning.training.module import TraceModule
from trace_lightning.training.rollout_correction import RolloutCorrection
from trace_lightning.packing.trees import WEIGHT_KEYS, tree_minibatches, update_units
from builders.models import policy
from builders.packing import leaf_micro, sequences, with_old_logprobs_near
from builders.training import perturbed, sampled_minibatches
from builders.trees import hand_trees

# Four pairs in two leaves: leaf 0 has ratios 3 and 0.4 (product 1.2, geometric mean
# sqrt(1.2) = 1.0954), leaf 1 has 1.2 and 1.5 (product 1.8, geometric mean sqrt(1.8) = 1.3416).
RHO = torch.tensor([3.0, 0.4, 1.2, 1.5], dtype=torch.float64)
LEAF = torch.tensor([0, 0, 1, 1])


def weights(**kw) -> tuple[list[float], dict[str, float]]:
    w, stats = correction_weights(torch.log(RHO), LEAF, 2, **kw)
    return w.tolist(), {k: float(v) for k, v in stats.items()}


def test_token_tis_by_hand():
    # min(rho, 2): [2, 0.4, 1.2, 1.5]; only 3 is above 2: 1 of 4 pairs truncated
    w, s = weights(rollout_is="token", rollout_is_threshold=2.0)
    assert w == pytest.approx([2.0, 0.4, 1.2, 1.5], rel=1e-12)
    assert s["is_truncated_share"] == 0.25 and s["rejected_share"] == 0.0
    assert s["weight_mean"] == pytest.approx((2.0 + 0.4 + 1.2 + 1.5) / 4, rel=1e-12)


def test_sequence_tis_by_hand():
    # each leaf's product: 1.2 and 1.8, both under 2, broadcast to its pairs
    w, s = weights(rollout_is="sequence", rollout_is_threshold=2.0)
    assert w == pytest.approx([1.2, 1.2, 1.8, 1.8], rel=1e-12)
    assert s["is_truncated_share"] == 0.0
    # C = 1.5 cuts leaf 1's 1.8 to 1.5: its 2 pairs of 4 truncated
    w, s = weights(rollout_is="sequence", rollout_is_threshold=1.5)
    assert w == pytest.approx([1.2, 1.2, 1.5, 1.5], rel=1e-12)
    assert s["is_truncated_share"] == 0.5


def test_token_mis_by_hand():
    # kept when 1/2 <= rho <= 2 (upper defaults to rollout_is_threshold, lower to 1/upper):
    # 3 and 0.4 are rejected; no IS weights: the kept pairs weigh 1
    w, s = weights(rollout_rs="token", rollout_is_threshold=2.0)
    assert w == [0.0, 0.0, 1.0, 1.0]
    assert s["rejected_share"] == 0.5 and s["is_truncated_share"] == 0.0
    # an explicit band [0.3, 3.5] keeps all four
    assert weights(rollout_rs="token", rollout_rs_threshold=3.5,
                   rollout_rs_threshold_lower=0.3)[0] == [1.0] * 4


def test_sequence_and_geometric_mis_by_hand():
    # sequence: products 1.2 (kept) and 1.8 (past 1.5): leaf 1's pairs rejected
    w, s = weights(rollout_rs="sequence", rollout_rs_threshold=1.5)
    assert w == [1.0, 1.0, 0.0, 0.0] and s["rejected_share"] == 0.5
    # geometric: 1.0954 (kept) and 1.3416 (past 1.3): the same leaf rejected; 1.4 keeps both
    assert weights(rollout_rs="geometric", rollout_rs_threshold=1.3)[0] == [1.0, 1.0, 0.0, 0.0]
    assert weights(rollout_rs="geometric", rollout_rs_threshold=1.4)[0] == [1.0] * 4
    # lower bound 1.1 (geometric mean 1.0954 below it) rejects leaf 0 instead
    assert weights(rollout_rs="geometric", rollout_rs_threshold=1.4,
                   rollout_rs_threshold_lower=1.1)[0] == [0.0, 0.0, 1.0, 1.0]


def test_tis_with_rejection_and_veto_by_hand():
    # token TIS [2, 0.4, 1.2, 1.5] times sequence MIS at 1.5 [1, 1, 0, 0]
    w, _ = weights(rollout_is="token", rollout_rs="sequence", rollout_rs_threshold=1.5)
    assert w == pytest.approx([2.0, 0.4, 0.0, 0.0], rel=1e-12)
    # a veto at 0.5: leaf 0 holds a 0.4, so both its pairs go, whatever their ratios
    w, s = weights(rollout_is="token", rollout_token_veto_threshold=0.5)
    assert w == pytest.approx([0.0, 0.0, 1.2, 1.5], rel=1e-12)
    assert s["veto_share"] == 0.5 and s["rejected_share"] == 0.5


def test_mismatch_by_hand():
    # token a: rho 2 on 2 pairs, token b: rho 0.5 on 1 pair, the third token off the mask
    # k1 = mean(-log rho) = (-2 ln 2 + ln 2) / 3 = -ln2 / 3
    # k3 = mean(rho - 1 - ln rho) = (2 (1 - ln 2) + (-0.5 + ln 2)) / 3
    log_rho = torch.tensor([[math.log(2.0), math.log(0.5), 5.0]], dtype=torch.float64)
    count = torch.tensor([[2.0, 1.0, 0.0]])
    s = {k: float(v) for k, v in mismatch_stats(log_rho, count, bound=1.5).items()}
    assert s["k1_kl"] == pytest.approx(-math.log(2) / 3, rel=1e-12)
    assert s["k3_kl"] == pytest.approx((2 * (1 - math.log(2)) - 0.5 + math.log(2)) / 3,
                                       rel=1e-12)
    assert s["max_ratio"] == pytest.approx(2.0) and s["min_ratio"] == pytest.approx(0.5)
    assert s["share_past_bound"] == 1.0 and s["pairs"] == 3.0  # both outside [2/3, 3/2]
    assert float(mismatch_stats(log_rho, count, bound=2.5)["share_past_bound"]) == 0.0
    # no pair (a filler micro-batch): neutral extremes, so a max / min over micro-batches
    # and ranks is the real one
    none = mismatch_stats(log_rho, torch.zeros_like(count), bound=2.0)
    assert float(none["max_ratio"]) == 0.0 and float(none["min_ratio"]) == math.inf
    assert float(none["pairs"]) == 0.0 and float(none["k3_kl"]) == 0.0


def test_fold_sums_each_leafs_weighted_advantage_on_a_shared_token():
    # token (0, 1) is shared by leaf 0 (A = +1, w = 1.5) and leaf 1 (A = +2, w = 0.5) and
    # leaf 2 (A = -1, w = 2): adv_pos = 1.5 + 1.0 = 2.5, adv_neg = -2; token (0, 2) leaf 0's
    base = {k: torch.zeros(1, 3, dtype=torch.float64) for k in WEIGHT_KEYS}
    base["count"][0, 1:] = torch.tensor([3.0, 1.0])
    row, pos = torch.tensor([0, 0, 0, 0]), torch.tensor([1, 1, 1, 2])
    out = fold_pair_weights(torch.tensor([1.5, 0.5, 2.0, 1.5], dtype=torch.float64), row, pos,
                            torch.tensor([1.0, 2.0, -1.0, -4.0]), base)
    assert out["adv_pos"].tolist() == [[0.0, 2.5, 0.0]]
    assert out["adv_neg"].tolist() == [[0.0, -2.0, -6.0]]
    assert out["count"] is base["count"]  # the divisor's pairs are unchanged


@pytest.mark.parametrize("flag,value", [("rollout_is", "tokens"), ("rollout_rs", "seq"),
                                        ("rollout_is_threshold", 0.0),
                                        ("rollout_rs_threshold_lower", 5.0),
                                        ("rollout_token_veto_threshold", 2.0)])
def test_bad_settings_name_the_flag(flag, value):
    with pytest.raises(ValueError, match=f"--model.{flag}"):
        TraceModule(policy_path="unused", **{flag: value})


MODES = [dict(rollout_is="token"), dict(rollout_is="sequence", rollout_is_threshold=1.5),
         dict(rollout_rs="token", rollout_rs_threshold=1.3),
         dict(rollout_rs="sequence", rollout_rs_threshold=3.0),
         dict(rollout_is="token", rollout_rs="geometric", rollout_rs_threshold=1.1,
              rollout_token_veto_threshold=0.6)]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "+".join(map(str, m.values())))
def test_packed_corrected_update_equals_the_per_leaf_one(model_state, mode):
    """The corrected loss and gradients of the packed trees (pairs folded per token) equal
    the per-leaf rows' (each row a leaf) in float64; the weights bite (some differ from 1)."""
    model = policy(model_state)
    trees = hand_trees()
    with_old_logprobs_near(model, trees)
    seqs = sequences(trees, "tree_grpo")
    pairs = float(sum(sum(s.policy_mask) for s in seqs))
    units = [update_units(t, [s for s in seqs if s.tree_id == t.tree_id], 4096) for t in trees]
    packed = tree_minibatches(units, 1, 4096, pad_id=0, seed=0)[0]["micro"]
    corr = RolloutCorrection(**mode)
    results = []
    for micro in (leaf_micro(seqs, 4096), packed):
        model.zero_grad(set_to_none=True)
        total, rc = 0.0, {}
        for mb in micro:
            logp, _ = TraceModule._logprobs(model, mb)
            old, w, stats = corr.apply(mb, logp, first=True)
            loss, _ = weighted_policy_loss(logp, old.to(logp.dtype), w, normalizer=pairs)
            loss.backward()
            total += loss.item()
            n = float(stats["rollout_correction/pairs"])
            for k in ("weight_mean", "rejected_share", "k3_kl"):
                rc[k] = rc.get(k, 0.0) + float(stats[f"rollout_correction/{k}"]) * n
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((total, rc, grads))
    (want, want_rc, want_g), (got, got_rc, got_g) = results
    assert got == pytest.approx(want, rel=1e-10, abs=1e-12)
    for k in want_rc:
        assert got_rc[k] == pytest.approx(want_rc[k], rel=1e-10, abs=1e-12), k
    assert want_rc["weight_mean"] != pytest.approx(pairs, rel=1e-3)  # the weights bite
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-10,
                                   atol=1e-10 * float(g.abs().max()), msg=name)


def fit_logged(policy_dir, batches, **kw) -> list[dict]:
    """Train on ``batches`` (one RL step) and return each optimizer step's logged metrics."""
    class Keep(Logger):  # what reaches a logger, step by step
        name, version = "keep", 0
        steps: dict[int, dict] = {}

        def log_metrics(self, metrics, step=None):
            self.steps.setdefault(step, {}).update(metrics)

        def log_hyperparams(self, *args, **kwargs):
            pass

    module = TraceModule(policy_path=str(policy_dir), lr=1e-3, **kw)
    module.configure_model()
    module.prepare_update(batches)  # what the DataModule does once the step is batched
    keep = Keep()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=keep,
                        log_every_n_steps=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return [{k: float(v) for k, v in keep.steps[s].items()} for s in sorted(keep.steps)]


def test_a_real_mismatch_is_measured_and_the_correction_bounds_the_weights(policy_dir):
    """Sampled by the trainer's own weights the mismatch is nil; sampled by weights that
    differ from them (as an engine a step behind, or in bf16) the logged k3 KL, max ratio
    and share past the bound rise; off, only the step's first mini-batch logs them (no extra
    pass); with token TIS on, every mini-batch does, and each pair's weight is its ratio cut
    at the threshold."""
    trainer_policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    for mb in sampled_minibatches(trainer_policy, 1, seed=0)[0]["micro"]:
        with torch.no_grad():
            logp, _ = TraceModule._logprobs(trainer_policy, mb)
        same = RolloutCorrection().apply(mb, logp, first=True)[2]
        assert float(same["rollout_correction/k3_kl"]) < 1e-9
        assert float(same["rollout_correction/max_ratio"]) == pytest.approx(1.0, abs=1e-5)

    behind = perturbed(policy_dir)
    batches = sampled_minibatches(behind, 2, seed=0)
    # C = 1.2: a tiny random policy's distributions are flat, its ratios near 1
    off = fit_logged(policy_dir, batches, rollout_is_threshold=1.2)
    assert off[0]["rollout_correction/k3_kl"] > 1e-3
    assert off[0]["rollout_correction/max_ratio"] > 1.2
    assert off[0]["rollout_correction/share_past_bound"] > 0
    # off: the first mini-batch only, written once (not repeated at the second step)
    assert len(off) == 2 and "rollout_correction/k3_kl" not in off[1]
    on = fit_logged(policy_dir, sampled_minibatches(behind, 2, seed=0), rollout_is="token",
                    rollout_is_threshold=1.2)
    # the same tokens at the same start weights: the first mini-batch's mismatch is the same
    assert on[0]["rollout_correction/k3_kl"] == pytest.approx(off[0]["rollout_correction/k3_kl"],
                                                              rel=1e-5)
    for step in on:  # both mini-batches, the second from the step's start weights
        assert step["rollout_correction/max_ratio"] > 1.2
        assert 0 < step["rollout_correction/is_truncated_share"] < 1
        assert step["rollout_correction/weight_mean"] < step["rollout_correction/max_ratio"]
    # the per-pair weights themselves: all within [0, 1.2], some cut at 1.2
    module = TraceModule(policy_path=str(policy_dir), rollout_is="token",
                         rollout_is_threshold=1.2)
    module.configure_model()
    mb = batches[0]["micro"][0]
    with torch.no_grad():
        logp, _ = module._logprobs(module.policy, mb)
    _, w, _ = module.correction.apply(mb, logp, first=True)
    raw = (logp - mb["old_logprobs"]).exp() * mb["policy_mask"]  # (B, T) ratios
    got = (w["adv_pos"] - w["adv_neg"]).abs()  # (B, T): |A| w with |A| = 1 here
    assert float(got.max()) == pytest.approx(1.2) and float(raw.max()) > 1.2
    torch.testing.assert_close(got, torch.where(mb["policy_mask"] > 0, raw.clamp(max=1.2),
                                                torch.zeros_like(raw)).double())


def test_the_later_minibatches_read_the_steps_start_weights(policy_dir):
    """prepare_update gives every micro-batch after the first mini-batch the policy's
    log-probs before any optimizer step (off: it runs nothing)."""
    sampler = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    batches = sampled_minibatches(sampler, 3, seed=1)
    module = TraceModule(policy_path=str(policy_dir))
    module.configure_model()
    module.prepare_update(batches)
    assert not any("start_logprobs" in mb for m in batches for mb in m["micro"])
    module = TraceModule(policy_path=str(policy_dir), rollout_rs="token")
    module.configure_model()
    module.prepare_update(batches)
    assert not any("start_logprobs" in mb for mb in batches[0]["micro"])
    for m in batches[1:]:
        for mb in m["micro"]:
            with torch.no_grad():
                want, _ = TraceModule._logprobs(sampler, mb)
            torch.testing.assert_close(mb["start_logprobs"], want, rtol=1e-5, atol=1e-5)


def test_correction_on_without_start_logprobs_is_an_error(policy_dir):
    """A later mini-batch without the step's start log-probs cannot be corrected: the error
    names what is missing rather than weighting by the moved policy."""
    sampler = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    mb = sampled_minibatches(sampler, 1, seed=2)[0]["micro"][0]
    corr = RolloutCorrection(rollout_is="token")
    with pytest.raises(RuntimeError, match="prepare_update"):
        corr.apply(mb, torch.zeros_like(mb["old_logprobs"]), first=False)
    assert RolloutCorrection().apply(mb, torch.zeros_like(mb["old_logprobs"]),
                                     first=False)[2] == {}


DDP_SCRIPT = r'''
import json, sys
import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM
from launch import leave_group
from builders.training import perturbed, sampled_minibatches
from trace_lightning.training.module import TraceModule
from trace_lightning.packing.leaves import equalise_over_ranks

KW = dict(rollout_is="token", rollout_is_threshold=1.2)


class Keep(Logger):
    name, version, steps = "keep", 0, {}
    def log_metrics(self, metrics, step=None):
        self.steps.setdefault(step, {}).update({k: float(v) for k, v in metrics.items()})
    def log_hyperparams(self, *args, **kwargs):
        pass


class Data(L.LightningDataModule):
    """Rank 0 sampled by the trainer's own weights, rank 1 by perturbed ones."""
    def train_dataloader(self):
        rank = self.trainer.global_rank
        policy = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
        sampler = policy if rank == 0 else perturbed(sys.argv[1])
        batches = sampled_minibatches(sampler, 2, seed=rank)
        module = self.trainer.lightning_module
        local = []  # this rank's own statistics at the start weights, per mini-batch
        for m in batches:
            parts = []
            for mb in m["micro"]:
                with torch.no_grad():
                    logp, _ = TraceModule._logprobs(policy, mb)
                parts.append({k: float(v) for k, v in
                              module.correction.apply(mb, logp, first=True)[2].items()})
            local.append(parts)
        with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
            json.dump(local, f)
        batches = equalise_over_ranks(batches, 0)
        module.prepare_update(batches)
        return DataLoader(batches, batch_size=None, collate_fn=lambda b: b)


if __name__ == "__main__":
    keep = Keep()
    t = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, logger=keep,
                  use_distributed_sampler=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    t.fit(TraceModule(policy_path=sys.argv[1], lr=1e-3, **KW), datamodule=Data())
    if t.global_rank == 0:
        with open(f"{sys.argv[2]}/logged.json", "w") as f:
            json.dump([keep.steps[s] for s in sorted(keep.steps)], f)
    leave_group()
'''


def test_two_ranks_log_the_mismatch_over_both(policy_dir, tmp_path):
    """Two CPU processes (gloo DDP), one sampled without mismatch and one with: each logged
    mean is over both ranks' pairs, the max and min ratios over both, at both optimizer
    steps (the second from the start weights prepare_update read on each rank)."""
    from launch import run_ranks

    script = tmp_path / "ddp_rc.py"
    script.write_text(DDP_SCRIPT)
    for r, (rc, out) in enumerate(run_ranks(script, [str(policy_dir), str(tmp_path)],
                                            tmp_path)):
        assert rc == 0, f"rank {r} failed:\n{out[-4000:]}"
    logged = json.loads((tmp_path / "logged.json").read_text())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(logged) == 2
    key = "rollout_correction/{}".format
    for step, got in enumerate(logged):
        parts = [p for rank in ranks for p in rank[step]]
        n = sum(p[key("pairs")] for p in parts)
        for name in ("k3_kl", "k1_kl", "share_past_bound", "is_truncated_share"):
            want = sum(p[key(name)] * p[key("pairs")] for p in parts) / n
            assert got[key(name)] == pytest.approx(want, rel=1e-4, abs=1e-7), (step, name)
        assert got[key("max_ratio")] == pytest.approx(max(p[key("max_ratio")] for p in parts),
                                                      rel=1e-5)
        assert got[key("min_ratio")] == pytest.approx(min(p[key("min_ratio")] for p in parts),
                                                      rel=1e-5)
        # the ranks differ: rank 0 has no mismatch, rank 1 some
        k3 = [sum(p[key("k3_kl")] for p in rank[step]) for rank in ranks]
        assert k3[0] < 1e-9 < 1e-4 < k3[1]
