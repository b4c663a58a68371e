"""End to end: `trace-lightning fit` / `validate` through the real CLI, engine, retriever and
Trainer on a small demo world; checkpoint resume; errors before any work starts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trace_lightning.allocation.features import confidence_features
from trace_lightning.cli import cli, main
from trace_lightning.tasks.search_qa.config import DemoConfig
from trace_lightning.training.export import export_checkpoint, policy_state
from trace_lightning.training.export import main as export_main
from trace_lightning.tree import read_jsonl

from trace_lightning.tasks.search_qa.environment import SEARCH_R1_INSTRUCTION as SEARCH_R1
from builders import REPO, demo_args, search_datamodule
from builders.packing import assert_packed_equals_per_leaf
from builders.models import in_float64

pytestmark = pytest.mark.slow


def scalars(root: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = sorted((root / "tensorboard").glob("version_*"))[-1:]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_fit_then_resume_continues_as_if_never_stopped(demo_dir, tmp_path, caplog,
                                                        monkeypatch):
    # A: two epochs straight
    # (with an lr warm-up over 3 of the 4 optimizer steps, so its schedule must resume too;
    # this small world's policy never succeeds, so the advantages are zero: weight decay moves
    # the policy off the KL reference, and the KL term then gives AdamW moments that the
    # resumed run must restore to end with the same weights)
    # (and root neighbours, whose memory must come back from the checkpoint too)
    warmup = ("--model.lr=2e-4", "--model.lr_warmup_steps=3", "--model.weight_decay=0.1",
              "--model.kl_coef=0.5", "--model.neighbours.k=4")
    a = tmp_path / "a"
    from trace_lightning.training.module import TraceModule

    synced_at = []  # the global step of every weight sync into the engine
    sync = TraceModule.sync_to_engine

    def counted(self, *args, **kwargs):
        synced_at.append(self.trainer.global_step)
        return sync(self, *args, **kwargs)

    monkeypatch.setattr(TraceModule, "sync_to_engine", counted)
    # "last" with no checkpoint yet starts from policy_path, and says so
    main(["fit", *demo_args(demo_dir, a, 2, *warmup), "--ckpt_path=last"])
    assert "--ckpt_path last: no last checkpoint" in caplog.text
    # epoch 0's rollout, its validation after 2 updates, epoch 1's rollout with the weights
    # that validation synced (not again), epoch 1's validation after 2 more
    assert synced_at == [0, 2, 4]
    monkeypatch.undo()
    # B: one epoch, "killed", then resumed from its last checkpoint for the second
    b = tmp_path / "b"
    main(["fit", *demo_args(demo_dir, b, 1, *warmup)])
    (ckpt,) = b.rglob("last.ckpt")
    # "last": B's first run's checkpoint, in version_0 (the resumed run logs to version_1),
    # saved at the end of epoch 0, which Lightning finishes again: without a second rollout
    caplog.set_level("INFO", logger="trace_lightning.data")
    main(["fit", *demo_args(demo_dir, b, 2, *warmup), "--ckpt_path=last"])
    assert "epoch 0's rollout is in the checkpoint: not rolled out again" in caplog.text

    # the same second-epoch trees: same prompts, same allocation, same sampled tokens
    ta = list(read_jsonl(a / "trees" / "epoch_1_rank_0.jsonl"))
    tb = list(read_jsonl(b / "trees" / "epoch_1_rank_0.jsonl"))
    assert [t.tree_id for t in ta] == [t.tree_id for t in tb]
    assert [len(t.leaves()) for t in ta] == [len(t.leaves()) for t in tb]
    assert [[n.token_ids for n in t.nodes] for t in ta] == [[n.token_ids for n in t.nodes]
                                                            for t in tb]
    # the same predictions steered them: the predictor, its replay and the prompt history
    # (demo.yaml sets model.history) came back from the checkpoint
    assert [t.root.prediction for t in ta] == pytest.approx([t.root.prediction for t in tb])
    saved = torch.load(ckpt, weights_only=False)["trace"]  # B's first run
    epoch0 = list(read_jsonl(b / "trees" / "epoch_0_rank_0.jsonl"))
    assert set(saved["history"]["counts"]) == {t.tree_id for t in epoch0}
    assert sorted(saved["neighbours"]["ids"]) == sorted(t.tree_id for t in epoch0)
    sa, sb = scalars(a), scalars(b)
    for key in ("train/loss", "rollout/reward_mean", "alloc/leaves", "val/em",
                "alloc/prompts_distinct"):
        assert sa[key][-1] == pytest.approx(sb[key][-1], abs=1e-5), key
    # AllocationSpread's prompts seen came back: the resumed epoch counts epoch 0's too
    opened = {t.tree_id for t in epoch0} | {t.tree_id for t in tb}
    assert len(opened) > len({t.tree_id for t in tb})
    assert sb["alloc/prompts_distinct"] == [len(opened)]
    # the same weights at the end: the optimizer's moments and step count came back too
    # (a reset step count alone changes the third update by about a third of lr)
    assert sa["train/kl_ref"][-1] > 0 and sa["train/grad_norm"][1] > 0  # moments before B stops
    resumed = max(b.rglob("last.ckpt"), key=lambda f: f.stat().st_mtime)
    assert resumed != ckpt
    wa = policy_state(torch.load(next(a.rglob("last.ckpt")), weights_only=False)["state_dict"],
                      "A")
    wb = policy_state(torch.load(resumed, weights_only=False)["state_dict"], "B")
    assert wa and set(wa) == set(wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-6, rtol=0)
    # lr of each step: 2e-4 times min(1, (s + 1) / 3); B's resumed epoch goes on
    # from its checkpointed schedule (a fresh schedule would start again at 2e-4 / 3)
    lr = 2.0e-4
    assert sa["train/lr"] == pytest.approx([lr / 3, 2 * lr / 3, lr, lr], rel=1e-6)
    assert sb["train/lr"][-2:] == pytest.approx([lr, lr], rel=1e-6)

    # the real fit logs every unconditional scalar key documented in callbacks/METRICS.md
    rows = [line.split("|") for line in (REPO / "callbacks" / "METRICS.md").read_text()
            .splitlines() if line.startswith("| `")]
    always = [r[1].strip().strip("`").replace("<dataset>", "demo_heldout") for r in rows
              if r[2].strip() == "scalar" and "when" not in r[5] and "CUDA" not in r[5]]
    assert len(always) > 50
    assert not [k for k in always if k not in sa], [k for k in always if k not in sa]
    # and the module's own keys are all in it
    listed = {r[1].strip().strip("`") for r in rows}
    unlisted = [k for k in sa if k.startswith(("train/", "predictor/", "rollout_correction/")) and k not in listed]
    assert not unlisted, unlisted
    # equal sampling cost: every step spends roots * (1 + continuations) leaves
    assert sa["alloc/leaves"] == [16.0, 16.0]
    # the predictor's fit once per RL step, not again at each of its two optimizer steps
    assert len(sa["train/loss"]) == 4 and len(sa["predictor/loss"]) == 2
    assert len(sa["perf/predictor_fit_s"]) == 2
    # the weight-sync check ran and passed
    assert max(sa["perf/sync_logprob_diff"]) < 1e-3
    # trees are real agent trajectories with observation tokens masked out
    leaf_seqs = [s for t in ta for s in t.flatten()]
    assert leaf_seqs and all(s.policy_mask[0] == 0 for s in leaf_seqs)
    searched = [n for t in ta for n in t.nodes if n.action == "search" and n.observation]
    assert searched, "no search turn with an observation in the trees"
    for n in searched:
        k = sum(n.policy_mask)
        assert n.policy_mask == [1] * k + [0] * (len(n.token_ids) - k)
    # on these real trees the packed update is the per-leaf one (float64), whole and split
    from transformers import AutoModelForCausalLM

    branched = [t for t in ta + epoch0 if len(t.leaves()) > 1]
    assert any(len(t.bare_rollouts()) < len(t.leaves()) for t in branched)  # continuations
    from trace_lightning.packing.attention import TREE_SDPA

    demo_policy = in_float64(AutoModelForCausalLM.from_pretrained(
        demo_dir / "model", attn_implementation=TREE_SDPA))
    for kind in ("tree_grpo", "segment", "branch_grpo"):
        assert_packed_equals_per_leaf(demo_policy, ta + epoch0, kind, rtol=1e-10)
    longest = max(len(s.input_ids) for t in ta for s in t.flatten())
    assert_packed_equals_per_leaf(demo_policy, ta, "grpo", rtol=1e-10, max_tokens=longest)


def test_fit_exports_the_trained_policy_for_transformers(demo_dir, tmp_path):
    """demo.yaml's ExportPolicy writes <log_dir>/policy/last when training ends: the weights
    of the final checkpoint (not the initial ones), loadable by transformers; and
    ``trace-lightning-export`` turns that checkpoint into the same directory. The run is
    GRPO's (``uniform``), which reads no predictions and so fits no predictor."""
    from transformers import AutoModelForCausalLM

    # this small world's policy rarely succeeds (zero advantages); weight decay moves every
    # weight anyway, so the export must be of the trained weights, not the initial ones
    main(["fit", *demo_args(demo_dir, tmp_path, 1, "--model.lr=1e-3",
                            "--model.weight_decay=0.1", "--data.allocator.kind=uniform")])
    run = tmp_path / "tensorboard" / "version_0"
    logged = scalars(tmp_path)
    assert "perf/sample_s" in logged and "train/loss" in logged
    assert not [k for k in logged if k.startswith("predictor/") or k == "perf/predictor_fit_s"]
    exported = AutoModelForCausalLM.from_pretrained(run / "policy" / "last").state_dict()
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    trained = policy_state(ckpt["state_dict"], "last.ckpt")
    initial = AutoModelForCausalLM.from_pretrained(demo_dir / "model").state_dict()
    assert set(exported) == set(trained) == set(initial)
    for name in trained:
        torch.testing.assert_close(exported[name], trained[name], atol=0, rtol=0)
    assert any(not torch.equal(trained[n], initial[n]) for n in trained)
    assert ckpt["trace"]["predictor_nodes_seen"] == 0 and ckpt["trace"]["replay"]["steps"] == []
    meta = json.loads((run / "policy" / "last" / "trace_lightning.json").read_text())
    assert (meta["epochs"], meta["global_step"]) == (1, 2)  # 1 epoch of 2 mini-batches

    export_main([str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "converted")])
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").state_dict()
    for name in trained:
        torch.testing.assert_close(converted[name], trained[name], atol=0, rtol=0)


def test_validate_last_checkpoint_samples_with_its_weights(demo_dir, tmp_path):
    """``validate --ckpt_path last`` (how a trained policy is scored, as the README says):
    the checkpoint is found in the fit's log version (validate logs to a new one, where
    Lightning's own lookup finds nothing and keeps the initial weights), and the engine,
    which starts from ``policy_path``, samples with the checkpoint's weights."""
    from transformers import AutoModelForCausalLM

    # decoupled weight decay of lr * wd = 0.1 per step: every weight x 0.81 after the 2
    # updates, which moves log-probs far more than the engine's numerics (1e-5) do
    main(["fit", *demo_args(demo_dir, tmp_path, 1, "--model.lr=1e-3",
                            "--model.weight_decay=100")])
    (ckpt,) = tmp_path.rglob("last*.ckpt")
    out = cli(["validate", *demo_args(demo_dir, tmp_path, 1), "--ckpt_path=last"])
    assert out.trainer.ckpt_path == str(ckpt)
    assert out.datamodule.sync_diff < 1e-3

    def logprobs(weights: dict[str, torch.Tensor], seq) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(demo_dir / "model", dtype=torch.float32)
        model.load_state_dict(weights)
        ids = torch.tensor([seq.input_ids])
        with torch.no_grad():
            lp = model(ids).logits.float().log_softmax(-1)[0, :-1]
        lp = lp.gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,) log p of each next token
        keep = torch.tensor(seq.policy_mask[1:], dtype=torch.bool)
        return lp[keep]

    trained = policy_state(torch.load(ckpt, weights_only=False)["state_dict"], "last.ckpt")
    initial = AutoModelForCausalLM.from_pretrained(demo_dir / "model").state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)
    (seq, *_) = out.datamodule.last_val_trees["demo_heldout"][0].flatten()
    sampled = torch.tensor(seq.logprobs)[torch.tensor(seq.policy_mask, dtype=torch.bool)]
    assert sampled.numel() > 5
    assert (sampled - logprobs(trained, seq)).abs().max() < 1e-3
    assert (sampled - logprobs(initial, seq)).abs().max() > 1e-2


def test_last_checkpoint_skips_links_to_deleted_checkpoints(tmp_path):
    """``last.ckpt`` is a link (``save_last: link``): one whose checkpoint was deleted (old
    versions pruned by hand) is skipped, not a FileNotFoundError, even when it is newest.
    (tests/training/test_checkpoints.py: a link a kill left dangling beside a newer checkpoint.)"""
    import os
    import time
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from trace_lightning.cli import last_checkpoint

    links = []
    for version in (0, 1):
        folder = tmp_path / "tb" / f"version_{version}" / "checkpoints"
        folder.mkdir(parents=True)
        torch.save({"state_dict": {}}, folder / "epoch=0-step=4.ckpt")  # it loads
        (folder / "last.ckpt").symlink_to("epoch=0-step=4.ckpt")
        links.append(folder / "last.ckpt")
    later = time.time() + 100
    os.utime(links[0].resolve(), (later, later))  # version_0's checkpoint is the newest...
    links[0].resolve().unlink()  # ...and deleted
    os.utime(links[0], (later, later), follow_symlinks=False)  # the link newest too
    trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint()],
                              loggers=[TensorBoardLogger(str(tmp_path), name="tb")],
                              default_root_dir=str(tmp_path))
    found, _, skipped = last_checkpoint(trainer)
    assert found == links[1]
    assert skipped == [f"{links[0]} (links to epoch=0-step=4.ckpt, which was deleted)"]


def test_a_resumed_epoch_is_rolled_out_again_only_when_it_was_not_finished(demo_dir):
    """Resumed from the checkpoint of an epoch whose rollout it holds, Lightning asks for
    that epoch's dataloader again: finished (an epoch-end checkpoint), a placeholder that no
    batch reads; unfinished (a mid-epoch checkpoint), its remaining batches run on a new
    rollout. Either way the next checkpoint still knows the epoch was rolled out."""
    from types import SimpleNamespace


    class RolledOut(Exception):
        pass

    def rollout():
        raise RolledOut

    for finished in (True, False):
        dm = search_datamodule(demo=DemoConfig(out_dir=str(demo_dir)),
                             policy_path=str(demo_dir / "model"))
        progress = SimpleNamespace(is_last_batch=finished)
        dm.trainer = SimpleNamespace(current_epoch=3, global_rank=0, world_size=1,
                                     fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(
                                         batch_progress=progress)))
        dm.load_state_dict({**dm.state_dict(), "rollout_epoch": 3})
        dm.session.engine = SimpleNamespace(wake_up=lambda: None, sleep=lambda: None)
        dm._rollout = rollout
        if finished:
            (placeholder,) = list(dm.train_dataloader())
            assert placeholder == {"micro": [], "n_tokens": 0.0}
            assert dm.state_dict()["rollout_epoch"] == 3
        else:
            with pytest.raises(RolledOut):
                dm.train_dataloader()


def test_validate_last_without_a_checkpoint_is_a_clear_error(demo_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="--ckpt_path last: no last checkpoint") as err:
        main(["validate", *demo_args(demo_dir, tmp_path, 1), "--ckpt_path=last"])
    assert str(tmp_path / "tensorboard" / "*" / "checkpoints") in str(err.value)


def test_validate_reports_per_dataset_accuracy(demo_dir, tmp_path, recwarn):
    out = cli(["validate", *demo_args(demo_dir, tmp_path, 1)])
    metrics = out.trainer.callback_metrics
    assert "val/demo_heldout/em" in metrics and "val/demo_heldout/questions" in metrics
    # 16 questions x the demo config's 2 samples each
    assert float(metrics["val/demo_heldout/questions"]) == 32
    # the held-out set searches its own corpus; validating never indexes the training one
    assert list(out.datamodule.task._retrievers) == [str(demo_dir / "eval_corpus.jsonl")]
    # vLLM starts torch.distributed in this one process; QAAccuracy's values are reduced
    # already, so Lightning's advice to log them with sync_dist=True is not shown
    assert not [w for w in recwarn if "self.log('val/" in str(w.message)]


def test_validation_after_an_epoch_scores_the_updated_policy(demo_dir, tmp_path, monkeypatch):
    # Lightning builds the validation loaders before the first epoch; the rollouts must
    # still be sampled after that epoch's updates, with freshly synced weights.
    # The engine is awake for every weight load and generate call (rollouts, validation)
    # and asleep for every training batch: vLLM's sleep mode frees the GPU there (CUDA only;
    # on this CPU build sleep frees nothing, but the phases are the same calls).
    from trace_lightning.rollout.engines.vllm_engine import VLLMEngine
    from trace_lightning.training.module import TraceModule

    seen: dict[str, list] = {"generate": [], "load_weights": [], "train": [], "predict": [],
                             "threads": []}

    def spy(name, fn, awake):
        def wrapped(self, *args, **kwargs):
            seen[name].append(awake(self))
            seen["threads"].append((name, torch.get_num_threads()))
            return fn(self, *args, **kwargs)
        monkeypatch.setattr(cls[name], fn.__name__, wrapped)

    cls = {"generate": VLLMEngine, "load_weights": VLLMEngine, "train": TraceModule,
           "predict": TraceModule}
    spy("generate", VLLMEngine.generate, lambda e: e.awake)
    spy("load_weights", VLLMEngine.load_weights, lambda e: e.awake)
    spy("train", TraceModule.training_step, lambda m: m.trainer.datamodule.engine.awake)
    spy("predict", TraceModule.predict_trees, lambda m: m.trainer.datamodule.engine.awake)
    # the process's own torch threads (vLLM may have replaced torch.set_num_threads already)
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)
    try:
        out = cli(["fit", *demo_args(demo_dir, tmp_path, 1,
                                     "--model.featuriser.confidence=true",
                                     "--model.featuriser.task_features=3")])
        after = torch.get_num_threads()
    finally:
        torch._C.set_num_threads(before)
    assert out.trainer.global_step == 2  # two mini-batch updates
    assert out.datamodule.last_val_step == 2
    assert out.datamodule.sync_diff < 1e-3
    # the predictor reads the policy's confidence after its hidden state (64 wide): a root
    # has no turns (zeros); a turn's mean log-prob, from vLLM's sampled log-probs, is below 0
    # and then the task's description of the prompt: how findable its documents are, which
    # the demo world's retriever gives again for the same question
    replay = out.model.predictor_life.replay.sample_all()
    assert replay.features.shape[1] == out.model.predictor.feature_mean.shape[0] == 64 + 4 + 3
    assert (replay.features[replay.depth == 0, 64:68] == 0).all()
    trees = [t for f in sorted((tmp_path / "trees").glob("*.jsonl")) for t in read_jsonl(f)]
    env = out.datamodule.task.environment(out.datamodule.tokenizer)
    examples = {e.id: e for e in out.datamodule.task.train_examples}
    for t in trees:
        assert t.prompt_features == env.prompt_features(examples[t.tree_id])
    described = {tuple(torch.tensor(t.prompt_features).tolist()) for t in trees}  # float32
    assert {tuple(f) for f in replay.features[:, 68:].tolist()} <= described
    conf = confidence_features(trees)
    turns = [conf[(t.tree_id, n.id)] for t in trees for n in t.nodes[1:]]
    assert turns and all(c[0] < 0 for c in turns)
    assert seen["train"] == [False, False]
    # on CPU the engine samples on one thread and training gets the process's two back, as
    # does the predictor's featurisation between sampling calls (the engine stays awake);
    # closing the engine leaves them with the process
    assert {n for name, n in seen["threads"] if name in ("train", "predict")} == {2}
    assert {n for name, n in seen["threads"] if name in ("generate", "load_weights")} == {1}
    assert seen["predict"] and all(seen["predict"])
    assert after == 2
    assert seen["generate"] and all(seen["generate"])
    assert len(seen["load_weights"]) == 2 and all(seen["load_weights"])  # rollout, validation
    # validating again in the same process (a notebook): fit's teardown closed the engine and
    # the new one starts from policy_path, so it gets the trained weights again, although
    # global_step has not moved since the last sync
    out.trainer.validate(out.model, datamodule=out.datamodule, verbose=False)
    assert len(seen["load_weights"]) == 3 and out.datamodule.sync_diff < 1e-3


def test_validate_averages_over_samples_at_temperature(demo_dir, tmp_path):
    # pass@1 from 3 samples per question at T=1: 48 scored rollouts; EM is a multiple of 1/48
    out = cli(["validate", *demo_args(demo_dir, tmp_path, 1), "--data.val_temperature=1.0",
               "--data.val_samples=3"])
    metrics = out.trainer.callback_metrics
    assert float(metrics["val/demo_heldout/questions"]) == 48
    em = float(metrics["val/demo_heldout/em"]) * 48
    assert em == pytest.approx(round(em), abs=1e-4)
    trees = out.datamodule.last_val_trees["demo_heldout"]
    assert len(trees) == 16 and all(len(t.leaves()) == 3 for t in trees)
    # pass@1: the mean over every sample, not one per question
    leaves = [leaf.metrics["em"] for t in trees for leaf in t.leaves()]
    assert em / 48 == pytest.approx(sum(leaves) / len(leaves), abs=1e-6)
    with pytest.raises(ValueError, match="--data.val_samples"):
        main(["validate", *demo_args(demo_dir, tmp_path, 1), "--data.val_temperature=0.0",
              "--data.val_samples=2"])


@pytest.mark.parametrize("override, message", [
    ("--data.allocator.kind=greedy", "kind"),
    ("--data.allocator.continuations=0", "continuations (0) must be >= 1"),
    ("--data.allocator.group_size=1", "group_size (1) must be >= 2"),
    ("--data.allocator.kind=uniform --data.candidates_per_step=1",
     "--data.candidates_per_step (1)"),
    ("--data.ppo_epochs=0", "--data.ppo_epochs (0)"),
    ("--model.lr_warmup_steps=-1", "--model.lr_warmup_steps (-1) must be >= 0"),
    ("--data.task.init_args.retriever_url=http://127.0.0.1:1 "
     "--data.task.init_args.retriever_timeout_s=0",
     "(--data.task.init_args.retriever_timeout_s) is 0.0; it must be a finite number of "
     "seconds > 0"),
    ("--data.oracle_samples=0", "--data.oracle_samples (0) must be >= 1"),
    ("--data.oracle_nodes=roots", "--data.oracle_nodes ('roots') must be 'all', 'roots' or "
                                  "'prefixes', and is 'all' unless --data.allocator.kind is "
                                  "'oracle' (it is 'trace')"),
    ("--model.dual_clip=0.5", "--model.dual_clip (0.5) must be > 1"),
    ("--model.predictor_holdout=1.0", "--model.predictor_holdout (1.0) must be in [0, 1)"),
    ("--model.kl_coef=-0.5", "--model.kl_coef (-0.5) must be >= 0"),
    ("--model.replay_steps=0", "--model.replay_steps (0) must be >= 1"),
    ("--model.dtype=bf16", "--model.dtype ('bf16') must be 'float32', 'bfloat16' or"),
    ("--data.sampling.top_p=0.9", "--data.sampling.top_p (0.9) 1.0: the update recomputes"),
    ("--data.sampling.temperature=0", "--data.sampling.temperature (0.0) must be > 0"),
    ("--data.task.init_args.env.topk=0", "--data.task.init_args.env.topk (0) must be >= 1"),
])
def test_bad_config_fails_before_any_work(demo_dir, tmp_path, override, message, capsys):
    with pytest.raises((SystemExit, ValueError)) as err:
        main(["fit", *demo_args(demo_dir, tmp_path, 1), *override.split()])
    text = str(err.value) + capsys.readouterr().err
    assert message in text
    assert not (tmp_path / "tensorboard").exists()  # nothing ran


@pytest.mark.parametrize("override, message", [
    ("--data.allocator.roots=0",
     "--data.allocator.roots (0) must be >= 2: a prompt needs two rollouts for any contrast"),
    ("--data.task.init_args.env.topk=0", "--data.task.init_args.env.topk (0) must be >= 1"),
])
def test_a_bad_value_in_an_optional_section_is_its_own_error(demo_dir, tmp_path, override,
                                                             message):
    """A section typed ``X | None`` fails in ``X``'s constructor, which jsonargparse wrapped
    as "Does not validate against any of the Union subtypes" with the message in the middle
    of the section's dump; the error is the constructor's own message."""
    with pytest.raises(ValueError) as err:
        main(["fit", *demo_args(demo_dir, tmp_path, 1), override])
    assert str(err.value) == message


def test_union_error_unwraps_only_a_single_real_error():
    from trace_lightning.cli import union_error

    wrapped = ("Does not validate against any of the Union subtypes\nSubtypes: [A, None]\n"
               "Errors:\n  - {}\n  - Expected a <class 'NoneType'>\nGiven value type: x\n"
               "Given value: Namespace(a=1)")
    assert union_error(wrapped.format("a (0) must be >= 1")) == "a (0) must be >= 1"
    assert union_error(wrapped.replace("Expected a <class 'NoneType'>", "b is wrong")
                       .format("a (0) must be >= 1")) is None  # two: left as it is
    assert union_error("a (0) must be >= 1") is None
    # a section's parse error: the key and its error, nested under the section's class
    nested = ("Problem with given class_path 'X':\n      Parser key \"kind\":\n"
              "        Expected a typing.Literal['vllm', 'hf']. Got value: vlm")
    assert union_error(wrapped.format(nested)) == \
        "key \"kind\": Expected a typing.Literal['vllm', 'hf']. Got value: vlm"


@pytest.mark.parametrize("override, message", [
    ("--data.engine.kind=vlm",
     "Parser key \"data.engine.kind\": Expected a typing.Literal['vllm', 'hf']. Got value: vlm"),
    ("--data.task.init_args.env.topk=abc",  # the task's section: its class, then the key
     "Parser key \"data.task\":\n  Problem with given class_path "
     "'trace_lightning.tasks.search_qa.SearchQAData':\n"
     "    Parser key \"env.topk\": Expected a <class 'int'>. Got value: abc"),
])
def test_a_value_that_does_not_parse_in_an_optional_section_is_its_own_error(override, message,
                                                                             capsys):
    """jsonargparse reported it as "Does not validate against any of the Union subtypes"
    with the section's subtypes, errors and given value around it (eight lines)."""
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"), override])
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"error: {message}")
    assert "Union subtypes" not in err


@pytest.mark.parametrize("logger, message", [
    ("false", "callbacks.RewardVariance logs metrics but the trainer has no logger"),
    ("lightning.pytorch.loggers.CSVLogger",
     "callbacks.AllocationSpread writes histograms (set `histograms: false`"),
])
def test_a_callback_without_its_logger_fails_before_the_demo_is_built(tmp_path, logger,
                                                                      message):
    """Lightning calls the callbacks' setup after the datamodule's prepare_data (minutes of
    demo world and warm start here): ``trace-lightning fit`` checks them first."""
    demo = tmp_path / "demo"
    args = ["fit", "--config", str(REPO / "configs" / "demo.yaml"),
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger={logger}",
            f"--data.task.init_args.demo.out_dir={demo}"]
    if logger != "false":
        args.append(f"--trainer.logger.init_args.save_dir={tmp_path}")
    with pytest.raises(ValueError) as err:
        main(args)
    assert message in str(err.value) and "trainer.logger" in str(err.value)
    assert not demo.exists()


def test_too_few_questions_for_the_ranks_or_the_allocator_fail_at_setup(shared_data, demo_dir,
                                                                        monkeypatch):
    """Before any engine starts: a training file with fewer questions than a step needs
    names --data.task.init_args.train (not candidates_per_step, which was not the problem); a
    validation set with fewer questions than processes (one would skip validation, the others
    hang) too."""
    from types import SimpleNamespace

    from trace_lightning.allocation.allocators import Allocator
    from trace_lightning.data import TraceDataModule
    from trace_lightning.tasks.search_qa.config import EvalSet

    hotpot = shared_data / "hotpotqa"
    uniform = Allocator("uniform", roots=16, continuations=0, max_rollouts_per_prompt=4,
                        group_size=4)  # 4 prompts a step
    dm = search_datamodule(train=str(hotpot / "dev_distractor.jsonl"),
                         corpus=str(hotpot / "corpus.jsonl"), policy_path=str(demo_dir / "model"),
                         allocator=uniform, candidates_per_step=8, train_limit=3)
    with pytest.raises(ValueError, match=r"3 training questions \(--data.task.init_args.train, "
                                         r"--data.train_limit 3\), fewer than the 4 prompts"):
        dm.setup("fit")
    empty = EvalSet("hotpotqa", str(hotpot / "dev_distractor.jsonl"), limit=0)
    dm = search_datamodule(train=str(hotpot / "dev_distractor.jsonl"),
                         corpus=str(hotpot / "corpus.jsonl"), policy_path=str(demo_dir / "model"),
                         allocator=uniform, val=[empty])
    with pytest.raises(ValueError, match=r"'hotpotqa' \(.*dev_distractor.jsonl\) holds no "
                                         r"questions \(limit 0\)"):
        dm.setup("validate")  # one process: nothing to validate, not "fewer than 1 processes"
    # a share of the validation batches: rollouts wasted, and a process with none would stop
    # alone; whole batches (an int) and 1.0 are fine
    for limit, fails in ((0.25, True), (2, False), (1.0, False)):
        dm = search_datamodule(train=str(hotpot / "dev_distractor.jsonl"),
                             corpus=str(hotpot / "corpus.jsonl"),
                             policy_path=str(demo_dir / "model"), allocator=uniform,
                             val=[EvalSet("hotpotqa", str(hotpot / "dev_distractor.jsonl"),
                                          limit=4)])
        dm.trainer = SimpleNamespace(global_rank=0, world_size=1, limit_val_batches=limit)
        if fails:
            with pytest.raises(ValueError, match=r"--trainer.limit_val_batches \(0.25\): "
                                                 r"validation rolls out all"):
                dm._setup("validate")
        else:
            dm._setup("validate")
    val = EvalSet("hotpotqa", str(hotpot / "dev_distractor.jsonl"), limit=1)
    dm = search_datamodule(train=str(hotpot / "dev_distractor.jsonl"),
                         corpus=str(hotpot / "corpus.jsonl"), policy_path=str(demo_dir / "model"),
                         allocator=uniform, val=[val])
    dm.trainer = SimpleNamespace(global_rank=0, world_size=2)
    told = []  # the other process (simulated: no process group here) did not fail
    monkeypatch.setattr(TraceDataModule, "_any_failed",
                        property(lambda self: lambda failed: told.append(failed) or failed))
    with pytest.raises(ValueError, match=r"'hotpotqa' \(.*dev_distractor.jsonl\) holds 1 "
                                         r"questions, fewer than the 2 processes"):
        dm.setup("validate")
    assert dm.engine is None  # nothing started
    assert told == [False, True]  # prepare_data's agreement, then setup's, which failed


def test_same_named_sets_and_missing_corpora_fail_before_any_work(shared_data, demo_dir,
                                                                   tmp_path):
    """Two validation sets of one name would share one metric key and one set of questions;
    a corpus that does not exist would fail only when first searched (a validation set's:
    after the first epoch trained, before its checkpoint)."""
    from trace_lightning.tasks.search_qa.config import EvalSet

    hotpot, wiki = shared_data / "hotpotqa", shared_data / "2wikimultihopqa"
    common = dict(train=str(hotpot / "dev_distractor.jsonl"), policy_path=str(demo_dir / "model"))
    with pytest.raises(ValueError,
                       match=r"--data.task.init_args.val names \['qa'\] more than once"):
        search_datamodule(corpus=str(hotpot / "corpus.jsonl"), **common,
                        val=[EvalSet("qa", str(hotpot / "dev_distractor.jsonl")),
                             EvalSet("qa", str(wiki / "dev.jsonl"), corpus=str(wiki / "corpus.jsonl"))])
    missing = str(tmp_path / "nowhere.jsonl")
    dm = search_datamodule(corpus=missing, **common)
    with pytest.raises(FileNotFoundError, match=r"--data.task.init_args.corpus: corpus "
                                                r"'.*nowhere.jsonl' does not exist"):
        dm.setup("fit")
    dm = search_datamodule(corpus=str(hotpot / "corpus.jsonl"), **common,
                         val=[EvalSet("wiki", str(wiki / "dev.jsonl"), corpus=missing)])
    with pytest.raises(FileNotFoundError,
                       match=r"--data.task.init_args.val\[0\].corpus \(set 'wiki'\)"):
        dm.setup("fit")
    assert dm.engine is None and not dm.task.train_examples  # nothing started
    # QA files before prepare_data downloads a policy or builds a demo; limits, and two
    # retrievers at once, at construction
    corpus = dict(corpus=str(hotpot / "corpus.jsonl"))
    with pytest.raises(FileNotFoundError,
                       match=r"--data.task.init_args.train: QA file '.*nowhere.jsonl' "):
        search_datamodule(**{**common, "train": missing}, **corpus).prepare_data()
    with pytest.raises(FileNotFoundError,
                       match=r"--data.task.init_args.val\[0\] \(set 'wiki'\): QA file"):
        search_datamodule(**common, **corpus, val=[EvalSet("wiki", missing)]).prepare_data()
    # files the demo writes are checked once it has (a learning benchmark's
    # --data.task.init_args.val); validate needs no training file
    from types import SimpleNamespace

    from trace_lightning.tasks.search_qa.config import DemoConfig

    demo = tmp_path / "demo"
    dm = search_datamodule(demo=DemoConfig(out_dir=str(demo)), policy_path=str(demo / "model"),
                         val=[EvalSet("held", str(demo / "eval_qa.jsonl"),
                                      corpus=str(demo / "eval_corpus.jsonl"))])
    dm.task._check_files(True, before_demo=True)
    with pytest.raises(FileNotFoundError,
                       match=r"--data.task.init_args.val\[0\] \(set 'held'\): QA file"):
        dm.task._check_files(True)
    dm = search_datamodule(**{**common, "train": missing}, **corpus)
    dm.trainer = SimpleNamespace(state=SimpleNamespace(fn="validate"))
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"--data.train_limit \(-3\) must be >= 0"):
        search_datamodule(**common, **corpus, train_limit=-3)
    with pytest.raises(ValueError, match=r"both --data.task.init_args.corpus "
                                         r"\('.*corpus.jsonl'\) and "
                                         r"--data.task.init_args.retriever_url "
                                         r"\('http://127.0.0.1:1'\)"):
        search_datamodule(**common, **corpus, retriever_url="http://127.0.0.1:1")


def test_bad_corpora_and_flags_fail_at_setup_or_construction(shared_data, demo_dir, tmp_path):
    """A validation corpus with a line that is not JSON fails at setup, before the engine
    starts (it used to fail at the first validation, epochs into a run, before that epoch's
    checkpoint); so does a corpus passed as a folder. A malformed retriever URL, a timeout
    that is not finite and an unknown demo option fail at construction, naming the flag (the
    last when the CLI parses --data.task.init_args.demo)."""
    from trace_lightning.tasks.search_qa.config import DemoConfig, EvalSet

    hotpot = shared_data / "hotpotqa"
    bad = tmp_path / "bad_corpus.jsonl"
    bad.write_text('{"id": "1", "contents": "A\\nfine passage"}\nnot json\n')
    common = dict(train=str(hotpot / "dev_distractor.jsonl"), policy_path=str(demo_dir / "model"),
                  corpus=str(hotpot / "corpus.jsonl"))
    dm = search_datamodule(**common, val=[EvalSet("v", str(hotpot / "dev_distractor.jsonl"),
                                                corpus=str(bad), limit=4)])
    with pytest.raises(ValueError, match=r"bad_corpus.jsonl.*line 2|bad_corpus.jsonl:2"):
        dm.setup("fit")
    assert dm.engine is None
    dm = search_datamodule(**{**common, "corpus": str(hotpot)})
    with pytest.raises(IsADirectoryError, match=r"--data.task.init_args.corpus: corpus "
                                                r"'.*hotpotqa' is a directory, not a file"):
        dm.setup("fit")
    no_corpus = {k: v for k, v in common.items() if k != "corpus"}
    with pytest.raises(ValueError, match=r"\(--data.task.init_args.retriever_url\) "
                                         r"'127.0.0.1:8000' is not an http\(s\) address"):
        search_datamodule(**no_corpus, retriever_url="127.0.0.1:8000")
    with pytest.raises(ValueError,
                       match=r"\(--data.task.init_args.retriever_timeout_s\) is nan; it must"):
        search_datamodule(**no_corpus, retriever_url="http://127.0.0.1:1",
                        retriever_timeout_s=float("nan"))
    with pytest.raises(ValueError,
                       match=r"\(--data.task.init_args.retriever_reconnect_wait_s\) is inf; it"):
        search_datamodule(**no_corpus, retriever_url="http://127.0.0.1:1",
                        retriever_reconnect_wait_s=float("inf"))
    dm = search_datamodule(**no_corpus, retriever_url="http://127.0.0.1:1",
                         retriever_reconnect_wait_s=4.5)
    assert dm.task._retriever(None).reconnect_wait_s == 4.5  # the flag reaches the client
    with pytest.raises(ValueError, match=r"--data.task.init_args.demo.options: 'n_peple' is not "
                                         r"an option.*n_people"):
        DemoConfig(out_dir=str(tmp_path / "demo"), options={"n_peple": 5})
    with pytest.raises(ValueError, match=r"sets 'seed', which is --data.task.init_args.demo.seed"):
        DemoConfig(out_dir=str(tmp_path / "demo"), options={"seed": 5})


def test_optimizer_flags_are_not_offered(capsys):
    """TraceModule configures its own policy and predictor optimizers; LightningCLI's
    --optimizer would override them with one optimizer over no parameters."""
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"), "--optimizer", "SGD"])
    assert exit_.value.code != 0
    assert "optimizer" in capsys.readouterr().err


@pytest.mark.parametrize("subcommand", ["test", "predict"])
def test_only_fit_and_validate_are_offered(subcommand, capsys):
    """The module has no test or predict step: Lightning's subcommands would parse, build the
    world and the engine, and then fail on the missing step."""
    with pytest.raises(SystemExit) as exit_:
        main([subcommand, "--config", str(REPO / "configs" / "demo.yaml")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"invalid choice: '{subcommand}' \(choose from '?fit'?, '?validate'?\)$",
                     err, re.M), err


def test_missing_policy_path_is_a_clear_error(tmp_path):
    (tmp_path / "q.jsonl").write_text("")  # the data files exist (checked first)
    (tmp_path / "c.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="--model.policy_path"):
        main(["fit", "--config", str(REPO / "configs" / "demo.yaml"),
              f"--model.policy_path={tmp_path / 'nope'}", "--data.task.init_args.demo=null",
              f"--data.task.init_args.train={tmp_path / 'q.jsonl'}",
              f"--data.task.init_args.corpus={tmp_path / 'c.jsonl'}",
              f"--trainer.default_root_dir={tmp_path}"])


def test_retriever_that_does_not_answer_fails_before_work(demo_dir, tmp_path, monkeypatch):
    import socket

    from trace_lightning import data

    # checked before prepare_data fetches the policy (a hub id: 16 GB for Qwen3-8B)
    monkeypatch.setattr(data, "local_model_dir",
                        lambda path: pytest.fail("the policy was fetched first"))

    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from trace_lightning.tasks.search_qa.retrieval import RetrieverError

    with pytest.raises(RetrieverError, match=f"127.0.0.1:{port}"):
        main(["fit", *demo_args(demo_dir, tmp_path, 1), "--data.task.init_args.demo=null",
              f"--data.task.init_args.train={demo_dir / 'train_qa.jsonl'}",
              f"--data.task.init_args.retriever_url=http://127.0.0.1:{port}"])
    assert not (tmp_path / "trees").exists()  # no rollout ran


def test_nan_reward_stops_the_step_without_a_checkpoint(demo_dir, tmp_path, monkeypatch):
    from trace_lightning.tasks.search_qa import environment

    original = environment.SearchEnvironment.score

    def nan_score(self, final, example, state=None):  # a reward function gone wrong
        reward, metrics = original(self, final, example, state)
        return float("nan"), metrics

    monkeypatch.setattr(environment.SearchEnvironment, "score", nan_score)
    with pytest.raises(ValueError, match="is not finite"):
        main(["fit", *demo_args(demo_dir, tmp_path, 1)])
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.fixture(scope="session")
def hotpot_policy(tmp_path_factory, shared_data) -> Path:
    """A tiny random Qwen3 with a tokenizer trained on real HotpotQA passages."""
    from trace_lightning.tasks.search_qa.environment import SEARCH_R1_INSTRUCTION
    from trace_lightning.models import build_tiny_model, train_tokenizer
    from trace_lightning.tasks.search_qa.tiny_policy import AGENT_TAGS
    from trace_lightning.tasks.search_qa.retrieval import load_corpus

    passages = load_corpus(shared_data / "hotpotqa" / "corpus.jsonl")[:3000]
    texts = [f"{p.title} {p.text}" for p in passages] + [SEARCH_R1_INSTRUCTION] * 20
    tok = train_tokenizer(texts, vocab_size=2048, special_tokens=AGENT_TAGS)
    out = tmp_path_factory.mktemp("hotpot") / "policy"
    build_tiny_model(tok, out, seed=0, hidden_size=64, layers=2, intermediate=128,
                     max_position=2048)
    return out


def test_validate_on_real_hotpotqa_dev(hotpot_policy, shared_data, tmp_path):
    hp = shared_data / "hotpotqa"
    val = [{"name": "hotpotqa", "path": str(hp / "dev_distractor.jsonl"),
            "corpus": str(hp / "corpus.jsonl"), "limit": 6}]
    out = cli(["validate", "--config", str(REPO / "configs" / "demo.yaml"),
                f"--trainer.default_root_dir={tmp_path}",
                f"--trainer.logger.init_args.save_dir={tmp_path}",
                f"--model.policy_path={hotpot_policy}", "--data.task.init_args.demo=null",
                f"--data.task.init_args.train={hp / 'dev_distractor.jsonl'}",
                f"--data.task.init_args.corpus={hp / 'corpus.jsonl'}",
                f"--data.task.init_args.val={json.dumps(val)}", "--data.engine.max_model_len=2048",
                "--data.task.init_args.env.max_seq_tokens=1536",
                "--data.task.init_args.env.use_chat_template=true",
                f"--data.task.init_args.env.instruction={json.dumps(SEARCH_R1)}",
                "--data.task.init_args.env.max_turns=2",
                "--data.sampling.max_tokens=32", "--data.val_temperature=0.0",
                "--data.val_samples=1"])
    metrics = out.trainer.callback_metrics
    # a random policy scores about zero; what is tested is the pipeline on real questions
    assert float(metrics["val/hotpotqa/questions"]) == 6
    trees = out.datamodule.last_val_trees["hotpotqa"]
    # the file's first six questions, with their gold answers and aliases
    from trace_lightning.tasks.search_qa.datasets import load_qa

    dev = load_qa(hp / "dev_distractor.jsonl", limit=6)
    assert [(t.question, t.answers) for t in trees] == [(e.question, e.answers) for e in dev]
    assert all(len(t.leaves()) == 1 for t in trees)
    # the logged scores are the leaves' own
    for key in ("em", "f1"):
        leaves = [t.leaves()[0].metrics[key] for t in trees]
        assert float(metrics[f"val/hotpotqa/{key}"]) == pytest.approx(sum(leaves) / 6, abs=1e-6)


def test_two_process_fsdp_fit_on_cpu_syncs_checkpoints_and_exports(demo_dir, tmp_path):
    """The GPU configs' sharded path on two CPU processes (CPUFSDPStrategy, gloo): every rank
    plans the same global budget and rolls out its own share of the prompts, the policy
    trains as FSDP shards on the mini-batches of both ranks, each rank's engine gets the
    gathered weights (checked), Lightning writes a sharded checkpoint, ExportPolicy writes
    the gathered policy on rank 0, ``trace-lightning-export`` reads the sharded checkpoint
    into the same weights, and a run resumed from it trains its predictor and policy on.
    (DDP runs the same data path: tests/training/test_rollout_correction.py fits the module
    under it.)"""
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    strategy = {"class_path": "trace_lightning.training.strategies.CPUFSDPStrategy",
                "init_args": {"auto_wrap_policy": [
                    "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer"],
                    "activation_checkpointing_policy": [
                        "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer"],
                    "state_dict_type": "sharded"}}
    # trace, 10 roots, one featuriser forward per path: the ranks need different numbers of
    # forwards, each a collective under FSDP, and predict their trees' prefixes on turns of
    # their own (a tree branches once its bare rollouts end), yet must still meet (this small
    # policy rarely searches; test_rollout.py has ranks that branch on different turns)
    args = demo_args(demo_dir, tmp_path, 1, "--trainer.devices=2",
                     f"--trainer.strategy={json.dumps(strategy)}", "--model.weight_decay=0.1",
                     "--data.allocator.kind=trace", "--data.allocator.roots=10",
                     "--model.featuriser.batch_tokens=1")
    script = Path(sys.executable).parent / "trace-lightning"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(script), "fit", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FullyShardedDataParallel" in proc.stdout + proc.stderr  # the policy's wrapper
    run = tmp_path / "tensorboard" / "version_0"
    logged = scalars(tmp_path)
    assert max(logged["perf/sync_logprob_diff"]) < 1e-3
    assert logged["alloc/leaves"] == [20.0]  # 10 roots x (1 + 1), over both ranks
    ranks = [list(read_jsonl(tmp_path / "trees" / f"epoch_0_rank_{r}.jsonl")) for r in (0, 1)]
    ids = [{t.tree_id for t in trees} for trees in ranks]
    # both ranks rolled out prompts, disjoint shares of the one budget (branching itself:
    # test_rollout.py)
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert sum(len(t.leaves()) for trees in ranks for t in trees) == 20
    # the training statistics are the mini-batches' over both ranks, not rank 0's share
    tokens = sum(sum(s.policy_mask) for trees in ranks for t in trees for s in t.flatten())
    assert sum(logged["train/policy_tokens"]) == tokens
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() and (ckpt / "meta.pt").exists() and len(list(ckpt.glob("*.distcp"))) == 2

    exported = AutoModelForCausalLM.from_pretrained(run / "policy" / "last").state_dict()
    converted = AutoModelForCausalLM.from_pretrained(
        export_checkpoint(ckpt, tmp_path / "converted")).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(demo_dir / "model").state_dict()
    assert set(exported) == set(converted) == set(initial)
    for name in initial:
        torch.testing.assert_close(exported[name], converted[name], atol=0, rtol=0)
        assert not torch.equal(exported[name], initial[name]), name  # trained: decayed

    # resumed for a second epoch from the sharded checkpoint: the predictor's optimizer
    # state comes back whole (see PredictorLife.optimizer) and both models step
    args = demo_args(demo_dir, tmp_path, 2, *args[args.index("--trainer.devices=2"):],
                     f"--ckpt_path={ckpt}")
    proc = subprocess.run([str(script), "fit", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = scalars(tmp_path)  # version_1: the resumed epoch's
    assert resumed["predictor/updates"][-1] > 0 and len(resumed["train/loss"]) == 2


PREPARE_RANKS_SCRIPT = '''
import sys
from pathlib import Path

import lightning as L
import torch

from trace_lightning.data import TraceDataModule
from trace_lightning.tasks.search_qa.config import DemoConfig
from trace_lightning.tasks.search_qa.data import SearchQAData

out = Path(sys.argv[1])

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

# a policy that is not the demo's: prepare_data, on local rank 0 alone, refuses it
dm = TraceDataModule(task=SearchQAData(demo=DemoConfig(out_dir=str(out / "world"))),
                     policy_path=str(out / "not_the_demo_policy"))
trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), datamodule=dm)
'''


def test_prepare_data_failing_on_rank_0_stops_every_rank(tmp_path):
    """Lightning runs ``prepare_data`` on one process per node; when it fails there, the
    other processes raise ``RankFailed`` at the start of setup, naming what failed, instead
    of waiting for it in Lightning's barrier (a 30-minute NCCL timeout under srun; under
    gloo here, a bare "Connection closed by peer")."""
    from launch import run_ranks

    script = tmp_path / "prepare_ranks.py"
    script.write_text(PREPARE_RANKS_SCRIPT)
    (rc0, out0), (rc1, out1) = run_ranks(script, [str(tmp_path)], tmp_path, timeout=180)
    assert rc0 not in (0, None) and rc1 not in (0, None), (out0[-3000:], out1[-3000:])
    assert "must be the demo's policy" in out0
    assert "RankFailed: another process failed preparing the data (prepare_data)" in out1, \
        out1[-3000:]


CHECKPOINT_RANKS_SCRIPT = '''
import json
import os
import sys
from pathlib import Path

from trace_lightning.cli import main

demo, out = Path(sys.argv[1]), Path(sys.argv[2])
args = json.loads(sys.argv[3])
# each process keeps its logs for itself, as on nodes without a shared file system: only
# process 0's folder holds an earlier run's last checkpoint (never loaded: setup stops first)
root = out / f"node_{os.environ['RANK']}"
if os.environ["RANK"] == "0":
    (root / "tensorboard" / "version_0" / "checkpoints").mkdir(parents=True)
    import torch  # the weights of a checkpoint of this model (setup checks their keys and
    # shapes before the processes agree)
    from transformers.utils import logging
    from trace_lightning.training.module import TraceModule
    module = TraceModule(policy_path=str(demo / "model"), predictor_hidden=128)  # demo.yaml's
    logging.disable_progress_bar()  # "Loading weights" is what the run below must not print
    module.configure_model()
    logging.enable_progress_bar()
    torch.save({"state_dict": module.state_dict()},
               root / "tensorboard" / "version_0" / "checkpoints" / "last.ckpt")
main(["fit", *args, f"--trainer.default_root_dir={root}",
      f"--trainer.logger.init_args.save_dir={root}", "--trainer.devices=2",
      "--trainer.strategy=ddp", "--ckpt_path=last"])
'''


def test_processes_finding_different_last_checkpoints_all_stop(demo_dir, tmp_path):
    """``--ckpt_path last`` is resolved by each process in its own log folder; where those
    differ (node-local folders), one process would resume and the other start afresh, or
    wait for it in the load. Both stop at setup, before any engine starts, with one error
    that lists what each found."""
    from launch import run_ranks

    script = tmp_path / "checkpoint_ranks.py"
    script.write_text(CHECKPOINT_RANKS_SCRIPT)
    args = [a for a in demo_args(demo_dir, tmp_path, 1)
            if not a.startswith(("--trainer.default_root_dir", "--trainer.logger.init_args"))]
    results = run_ranks(script, [str(demo_dir), str(tmp_path), json.dumps(args)], tmp_path,
                        timeout=300)
    found = tmp_path / "node_0" / "tensorboard" / "version_0" / "checkpoints" / "last.ckpt"
    for rc, out in results:
        assert rc not in (0, None), out[-3000:]
        assert "--ckpt_path: the processes found different checkpoints" in out, out[-3000:]
        assert f"process 0: {found}" in out and "process 1: none" in out, out[-3000:]
        assert "Loading" not in out and "Restoring states" not in out  # no load started


def test_a_checkpoint_missing_on_one_process_stops_at_setup(demo_dir, tmp_path, monkeypatch):
    """A --ckpt_path that is not there (a path, or ``validate --ckpt_path last`` finding
    none with several processes, deferred to here so the others are told): setup raises
    it before any engine starts, after telling the other processes."""
    from types import SimpleNamespace

    from trace_lightning.data import TraceDataModule

    def module():
        dm = search_datamodule(demo=DemoConfig(out_dir=str(demo_dir)),
                             policy_path=str(demo_dir / "model"))
        dm.trainer = SimpleNamespace(global_rank=0, world_size=2)
        return dm

    told = []  # the other process (simulated) did not fail
    monkeypatch.setattr(TraceDataModule, "_any_failed",
                        property(lambda self: lambda failed: told.append(failed) or failed))
    dm = module()
    dm.expect_checkpoint(str(tmp_path / "gone.ckpt"))
    with pytest.raises(FileNotFoundError, match=r"--ckpt_path: checkpoint '.*gone.ckpt' does "
                                                r"not exist on this process's file system"):
        dm.setup("fit")
    assert dm.engine is None and told == [False, True]
    dm, told[:] = module(), []
    dm.expect_checkpoint(None, FileNotFoundError("--ckpt_path last: no last checkpoint"))
    with pytest.raises(FileNotFoundError, match="no last checkpoint"):
        dm.setup("validate")
    assert dm.engine is None and told == [False, True]


def test_an_engine_failing_to_start_on_one_process_stops_every_process(demo_dir, monkeypatch):
    """vLLM out of GPU memory beside another job on one node: that process raises its own
    error after telling the others, which raise ``RankFailed`` instead of waiting for it in
    their first collective (the weight sync) until the process group's timeout. vLLM on GPUs
    under several processes runs collectives of its own while it starts: its memory is
    checked (and agreed on) before, and a failure inside it is not agreed on, since the
    others wait in vLLM's collective, not in ours. (No GPU here: the device is simulated.)"""
    from types import SimpleNamespace

    from trace_lightning.collectives import RankFailed
    from trace_lightning.data import TraceDataModule
    from trace_lightning.rollout.engines.config import EngineConfig

    def out_of_memory(*a, **k):
        raise RuntimeError("CUDA out of memory (simulated: no GPU here)")

    told = []  # the flags process 0 tells the other process (simulated)

    def setup(build, peer_fails_at: int | None = None, together: bool = False) -> None:
        """Set up as process 0 of two with ``build`` as the engine; the other process fails
        at its ``peer_fails_at``-th agreement, if at all."""
        told.clear()

        def any_failed(failed: bool) -> bool:
            told.append(failed)
            return failed or len(told) == peer_fails_at

        monkeypatch.setattr(EngineConfig, "build", build)
        monkeypatch.setattr(EngineConfig, "starts_together", lambda self, d, w: together)
        monkeypatch.setattr(TraceDataModule, "_any_failed", property(lambda self: any_failed))
        dm = search_datamodule(demo=DemoConfig(out_dir=str(demo_dir)),
                             policy_path=str(demo_dir / "model"))
        dm.trainer = SimpleNamespace(global_rank=0, world_size=2)
        dm.setup("fit")

    with pytest.raises(RuntimeError, match="out of memory"):
        setup(out_of_memory)
    # prepare_data's agreement, setup's, the tokenizer and device's, the engine's
    assert told == [False, False, False, True]
    with pytest.raises(RankFailed, match=r"another process failed starting the rollout engine"):
        setup(lambda *a, **k: "engine", peer_fails_at=4)
    assert told == [False, False, False, False]
    # the other process's GPU is taken: agreed on before any engine starts
    with pytest.raises(RankFailed, match=r"another process failed loading the tokenizer and "
                                         r"checking the engine's device"):
        setup(lambda *a, **k: pytest.fail("an engine started"), peer_fails_at=3)
    # vLLM's own collectives: its failure is not agreed on (a collective the other process,
    # waiting in vLLM's, would never join)
    with pytest.raises(RuntimeError, match="out of memory"):
        setup(out_of_memory, together=True)
    assert told == [False, False, False]


def test_gpu_memory_vllm_would_refuse_is_named_before_it_starts():
    """vLLM takes ``gpu_memory_utilization`` of the GPU's total memory and refuses to start
    with less free; the check names the flag, what is free, and the most it could take."""
    from trace_lightning.rollout.engines.config import EngineConfig
    from trace_lightning.rollout.engines.vllm_engine import check_gpu_memory

    gib = 2**30
    check_gpu_memory(free=30 * gib, total=80 * gib, utilization=0.3, device=0)  # 24 GiB: fits
    with pytest.raises(ValueError, match=r"--data.engine.gpu_memory_utilization \(0.5\) asks "
                                         r"vLLM for 40.0 GiB of GPU 3's 80.0 GiB, but only 30.0 "
                                         r"GiB are free .* at most 0.36"):
        check_gpu_memory(free=30 * gib, total=80 * gib, utilization=0.5, device=3)
    # collectives of its own only where vLLM starts on GPUs under several processes
    vllm, hf = EngineConfig(kind="vllm"), EngineConfig(kind="hf")
    assert vllm.starts_together("cuda", 2)
    assert not vllm.starts_together("cuda", 1) and not vllm.starts_together("cpu", 2)
    assert not hf.starts_together("cuda", 2)
    vllm.check_device("cpu")  # nothing to check on CPU


def test_validate_with_a_missing_checkpoint_path_fails_before_the_engine(demo_dir, tmp_path,
                                                                         monkeypatch):
    from trace_lightning.rollout.engines.config import EngineConfig

    def no_engine(*a, **k):
        raise AssertionError("the engine started before the checkpoint was checked")

    monkeypatch.setattr(EngineConfig, "build", no_engine)
    with pytest.raises(FileNotFoundError, match=r"--ckpt_path: checkpoint '.*nope.ckpt' does "
                                                r"not exist"):
        main(["validate", *demo_args(demo_dir, tmp_path, 1),
              f"--ckpt_path={tmp_path / 'nope.ckpt'}"])
    # not a checkpoint: a data file (Lightning's CLI unpickled it and advised
    # weights_only=False), and a Hugging Face model directory (failed after the engine)
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answers": ["a"]}\n')
    with pytest.raises(ValueError, match=r"--ckpt_path: .*train.jsonl does not load as a "
                                         r"checkpoint .* give the .ckpt file or directory"):
        main(["validate", *demo_args(demo_dir, tmp_path, 1),
              f"--ckpt_path={tmp_path / 'train.jsonl'}"])
    with pytest.raises(ValueError, match=r"--ckpt_path: .*model is a Hugging Face model "
                                         r"directory, not a Lightning checkpoint: train from "
                                         r"its weights with --model.policy_path"):
        main(["validate", *demo_args(demo_dir, tmp_path, 1),
              f"--ckpt_path={demo_dir / 'model'}"])


@pytest.mark.parametrize("flag", ["--trainer.default_root_dir",
                                  "--trainer.logger.init_args.save_dir", "--data.trees_dir"])
def test_an_output_folder_that_cannot_be_written_fails_before_any_work(demo_dir, tmp_path,
                                                                      monkeypatch, flag):
    """Each failed with a bare OSError: the logger's at the first log and --data.trees_dir
    at the first write, both after the first epoch's rollouts."""
    from trace_lightning.data import TraceDataModule

    def no_work(*a, **k):
        raise AssertionError("the data module prepared data before the folders were checked")

    monkeypatch.setattr(TraceDataModule, "prepare_data", no_work)
    (tmp_path / "a_file").write_text("")
    bad = tmp_path / "a_file" / "out"
    with pytest.raises(NotADirectoryError, match=rf"{re.escape(flag)}.*\({re.escape(str(bad))}"
                                                 rf"\) is not a folder this run can write into "
                                                 rf"\(Not a directory: .*\); give a writable"):
        main(["fit", *demo_args(demo_dir, tmp_path, 1), f"{flag}={bad}"])


def test_a_checkpoint_path_keeps_the_settings_given_and_names_those_that_differ(
        demo_dir, tmp_path, caplog, monkeypatch):
    """With ``--ckpt_path <file>`` Lightning's CLI replaced every --model.* value by the
    checkpoint's, silently (``last`` kept them); the settings given are used either way, a
    warning lists those that differ, a fit with no epoch left says so, and a predictor of
    another shape is named before the engine starts (not after, when its weights fail to
    load)."""
    from trace_lightning.rollout.session import EngineSession
    main(["fit", *demo_args(demo_dir, tmp_path, 1, "--model.lr=1e-3")])
    (ckpt,) = tmp_path.rglob("last*.ckpt")
    caplog.set_level("WARNING", logger="trace_lightning.cli")
    out = cli(["fit", *demo_args(demo_dir, tmp_path, 1, "--model.lr=1e-5"),
               f"--ckpt_path={ckpt}"])
    assert out.model.hparams.lr == 1e-5
    assert "--model.lr: 1e-05 (the checkpoint's: 0.001)" in caplog.text
    assert "the checkpoint already trained 1 epoch(s) and --trainer.max_epochs is 1" in \
        caplog.text
    saved = torch.load(ckpt, weights_only=False, mmap=True)["global_step"]
    assert out.trainer.global_step == saved == 2  # the checkpoint's: nothing trained
    caplog.clear()
    monkeypatch.setattr(EngineSession, "start",
                        lambda *args: pytest.fail("the engine started"))
    # predictor_hidden 8: its first layer is (8, 64 + 16), the checkpoint's (128, 64 + 16)
    # (64: the demo policy's hidden states; 16: the depth embedding); the bag-of-tokens
    # featuriser's 256 buckets: features of 256, not 64
    for flag, shapes in [("--model.predictor_hidden=8",
                          "predictor.mlp.0.weight (128, 80) (this run's: (8, 80))"),
                         ("--model.featuriser.kind=bag_of_tokens",
                          "predictor.feature_mean (64,) (this run's: (256,))"),
                         ("--model.featuriser.confidence=true",  # + 4 confidence numbers
                          "predictor.feature_mean (64,) (this run's: (68,))")]:
        with pytest.raises(ValueError, match=rf"--ckpt_path: the checkpoint's predictor does "
                                             rf"not fit this run's: .*"
                                             rf"{re.escape(shapes)}.*\(--model\.featuriser\)"
                                             rf" and its hidden width --model\."
                                             rf"predictor_hidden: use the settings of the run"):
            main(["validate", *demo_args(demo_dir, tmp_path, 1, flag), f"--ckpt_path={ckpt}"])
    assert "--model.predictor_hidden: 8 (the checkpoint's: 128)" in caplog.text
