"""The monitoring callbacks under a real Trainer and TensorBoardLogger, read back from disk.

The RL pipeline is replaced by ``StepData``, a test double of the datamodule's monitoring
surface (``last_step``, ``last_val_trees``, ``sync_diff``, ``timings``) that serves
hand-built steps (tests/builders/steps.py) the way ``TraceDataModule`` does: the step
of epoch ``e`` is built inside ``train_dataloader``. Everything else is real: the Trainer's
hook order, the logger, the event files and TensorBoard's own reader.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader

from callbacks import (AllocationSpread, PredictorCalibration, QAAccuracy, RewardVariance,
                       Throughput, TreeSamples)
from launch import run_ranks
from builders.steps import (EXPECTED_ALLOC, EXPECTED_PREDICTOR, EXPECTED_ROLLOUT, VAL_ROWS,
                            StepData, TinyModule, build_step, build_trees)

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

EXPECTED_VAL = {
    "val/hotpotqa/em": 2 / 3, "val/hotpotqa/f1": 2.5 / 3, "val/hotpotqa/reward": 2 / 3,
    "val/hotpotqa/searches": 1.0, "val/hotpotqa/malformed": 1 / 3,
    "val/hotpotqa/questions": 3.0,
    "val/nq/em": 0.0, "val/nq/f1": 0.1, "val/nq/reward": 0.0, "val/nq/searches": 1.0,
    "val/nq/malformed": 0.5, "val/nq/questions": 2.0,
    "val/em": (2 / 3 + 0.0) / 2, "val/f1": (2.5 / 3 + 0.1) / 2,
}
EXPECTED_PERF = {
    "perf/rollout_tokens_per_s": 500 / 2.0, "perf/rollout_s": 2.0, "perf/predict_s": 0.5,
    "perf/tools_s": 0.75,
    "perf/sync_s": 0.25, "perf/sync_logprob_diff": 0.003, "perf/prefix_cache_share": 200 / 800,
    "perf/rollout_engine_calls": 7.0, "perf/sample_s": 1.5,
}


def all_callbacks(jsonl: bool = False) -> list:
    return [RewardVariance(), AllocationSpread(), QAAccuracy(), PredictorCalibration(),
            TreeSamples(jsonl=jsonl), Throughput()]


def trainer(tmp_path: Path, callbacks: list, logger="tb", **kw) -> L.Trainer:
    if logger == "tb":
        logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    opts = dict(max_epochs=1, accelerator="cpu", devices=1, logger=logger,
                callbacks=callbacks, reload_dataloaders_every_n_epochs=1,
                enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, log_every_n_steps=1, default_root_dir=str(tmp_path))
    opts.update(kw)
    return L.Trainer(**opts)


def read_events(log_dir: str):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(log_dir, size_guidance={ea.SCALARS: 0, ea.IMAGES: 0,
                                                      ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    acc.Reload()
    return acc


def metrics_table() -> list[tuple[str, str, str]]:
    """(key, type, when) for every row of callbacks/METRICS.md the callbacks write (the
    module's own rows: test_fit.py, in a real fit)."""
    rows = []
    for line in (REPO / "callbacks" / "METRICS.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| (\w+) \| (\w+) \| .* \| (.*) \|$", line)
        if m and m.group(3) != "TraceModule":
            rows.append((m.group(1), m.group(2), m.group(4)))
    return rows


# ---- one real run, read back ---------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 epochs: the hand-built step; the same again; an empty step."""
    tmp = tmp_path_factory.mktemp("callbacks")
    steps = [build_step(0), build_step(1),
             build_step(2, trees=[], root_plan=[0] * 5)]
    steps[2].sequences, steps[2].seconds = [], {"rollout": 0.0, "tools": 0.0, "predict": 0.0}
    dm, model = StepData(steps), TinyModule()
    t = trainer(tmp, all_callbacks(jsonl=True), max_epochs=3)
    t.fit(model, datamodule=dm)
    fit_metrics = {k: float(v) for k, v in t.callback_metrics.items()}
    validated = t.validate(model, datamodule=dm, verbose=False)
    return {"trainer": t, "events": read_events(t.logger.log_dir), "fit": fit_metrics,
            "validate": validated[0], "log_dir": t.logger.log_dir}


def _first(acc, key: str) -> float:
    return acc.Scalars(key)[0].value


def test_metrics_table_lists_every_key_and_they_are_all_written(run):
    acc = run["events"]
    tags = acc.Tags()
    found = {"scalar": set(tags["scalars"]), "histogram": set(tags["histograms"]),
             "image": set(tags["images"]),
             "text": {t.removesuffix("/text_summary") for t in tags["tensors"]}}
    table = metrics_table()
    assert len(table) > 50
    expected = set()
    for key, kind, when in table:
        if "CUDA" in when:
            continue  # CPU test machine
        keys = [key.replace("<dataset>", d) for d in VAL_ROWS] if "<dataset>" in key else [key]
        for k in keys:
            expected.add(k)
            assert k in found[kind], f"{kind} {k} (METRICS.md) was not written"
    # and nothing namespaced is written that the table does not list
    ours = re.compile(r"^(rollout|alloc|val|predictor|perf|samples)/")
    written = {k for kind in found.values() for k in kind if ours.match(k)}
    assert written - expected == set(), "keys missing from METRICS.md"


def test_values_of_the_hand_built_step(run):
    acc = run["events"]
    for expected in (EXPECTED_ROLLOUT, EXPECTED_ALLOC, EXPECTED_PREDICTOR, EXPECTED_PERF):
        for k, v in expected.items():
            assert _first(acc, k) == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # epoch-start values sit at the step of the epoch's first training batch (2 per epoch)
    assert [e.step for e in acc.Scalars("rollout/reward_mean")] == [0, 2]
    assert [e.step for e in acc.Scalars("alloc/prompts_filtered")] == [0, 2, 4]
    # predictions in epochs 0 and 1; the empty epoch 2 logs no rollout statistics
    assert len(acc.Scalars("predictor/brier")) == 2
    # epoch 1 repeats epoch 0's step: the last step's mean outcome is this step's own mean,
    # so the skill against it is the skill against the hindsight mean
    for part in ("predictor", "predictor/roots", "predictor/prefixes"):
        (vs_previous,) = acc.Scalars(f"{part}/brier_skill_vs_previous")
        assert vs_previous.step == 2
        assert vs_previous.value == pytest.approx(acc.Scalars(f"{part}/brier_skill")[1].value,
                                                  rel=1e-5)
    assert [e.value for e in acc.Scalars("alloc/prompts_filtered")] == [2, 2, 5]
    for k in ("perf/train_s", "perf/train_tokens_per_s", "perf/epoch_s", "perf/rss_gb",
              "perf/peak_rss_gb"):
        values = [e.value for e in acc.Scalars(k)]
        assert len(values) == 3 and all(v > 0 for v in values[:2]), k
    # policy tokens: every leaf path's policy tokens = 3 per turn
    step = build_step()
    tokens = sum(sum(s.policy_mask) for s in step.sequences)
    e0 = acc.Scalars("perf/train_tokens_per_s")[0].value * acc.Scalars("perf/train_s")[0].value
    assert e0 == pytest.approx(tokens, rel=1e-4)
    # the step's cost without validation: the sampling phase plus the update, every epoch
    train_s = [e.value for e in acc.Scalars("perf/train_s")]
    assert [e.value for e in acc.Scalars("perf/step_s")] == pytest.approx(
        [1.5 + t for t in train_s], rel=1e-6)


def test_train_tokens_count_every_ppo_pass_and_only_epochs_with_a_step(tmp_path):
    """Two passes over the step's leaves train on twice its tokens; an epoch whose datamodule
    holds no step for it (here epoch 1 finds a step of epoch 5) logs no token rates."""
    dm = StepData([build_step(0), build_step(5)])
    dm.ppo_epochs = 2
    t = trainer(tmp_path, [Throughput()], max_epochs=2)
    with pytest.warns(UserWarning, match="no rollout step for epoch 1"):
        t.fit(TinyModule(), datamodule=dm)
    acc = read_events(t.logger.log_dir)
    tokens = sum(sum(s.policy_mask) for s in build_step().sequences)
    (rate,), (secs, _) = acc.Scalars("perf/train_tokens_per_s"), acc.Scalars("perf/train_s")
    assert rate.step == secs.step and rate.value * secs.value == pytest.approx(2 * tokens,
                                                                                rel=1e-4)
    assert len(acc.Scalars("perf/train_all_tokens_per_s")) == 1
    # per leaf (StepData packs nothing) the forwards read every leaf's tokens
    (every,), (forwarded,) = (acc.Scalars("perf/train_all_tokens_per_s"),
                              acc.Scalars("perf/train_forwarded_tokens_per_s"))
    assert forwarded.value == pytest.approx(every.value, rel=1e-6)


def test_forwarded_tokens_of_packed_trees_count_each_tree_token_once(tmp_path):
    """With tree packing, the forwards read each tree's tokens once: the trees' unique tokens,
    fewer than the leaves' sequences hold where leaves share prefixes."""
    from trace_lightning.packing.trees import unique_tokens

    dm = StepData([build_step(0)])
    dm.tree_packing = True
    t = trainer(tmp_path, [Throughput()], max_epochs=1)
    t.fit(TinyModule(), datamodule=dm)
    acc = read_events(t.logger.log_dir)
    step = build_step()
    unique = sum(unique_tokens(tr) for tr in step.trees if tr.leaves())
    every = sum(len(s.input_ids) for s in step.sequences)
    assert unique < every
    (rate,), (secs,) = (acc.Scalars("perf/train_forwarded_tokens_per_s"),
                        acc.Scalars("perf/train_s"))
    assert rate.value * secs.value == pytest.approx(unique, rel=1e-4)


def test_histograms(run):
    h = run["events"].Histograms("alloc/leaves_per_prompt")[0].histogram_value
    assert (h.num, h.sum, h.min, h.max) == (3, 10, 3, 4)
    h = run["events"].Histograms("alloc/continuations_per_prefix")[0].histogram_value
    assert (h.num, h.sum) == (3, 4)


def test_images_are_pngs(run):
    import matplotlib.image

    for tag in ("predictor/reliability", "samples/tree"):
        events = run["events"].Images(tag)
        assert events, tag
        png = events[0].encoded_image_string
        assert png.startswith(PNG), tag
        img = matplotlib.image.imread(io.BytesIO(png), format="png")
        assert img.ndim == 3 and img.shape[0] == events[0].height > 100, tag
        assert img.std() > 0.01, f"{tag} is blank"


def test_tree_text_and_jsonl(run):
    from trace_lightning.tree import read_jsonl

    events = run["events"].Tensors("samples/trees/text_summary")
    assert len(events) == 2  # epochs 0 and 1; the empty epoch has no trees
    text = events[0].tensor_proto.string_val[0].decode()
    # mixed trees first: A (4 leaves, one branch) then C
    assert text.index("Where is A?") < text.index("When was C?")
    assert "Who is B?" not in text
    assert "branched: +2 continuations" in text and "reward 1.00 ok" in text
    assert "obs:  Doc 1(Title: T)" in text and "**gold:** paris" in text
    trees = list(read_jsonl(Path(run["log_dir"]) / "trees" / "epoch_0_rank_0.jsonl"))
    assert [t.tree_id for t in trees] == ["q-a", "q-b", "q-c"]
    assert trees[0].nodes[1].continuations == 2


def test_qa_accuracy_in_tensorboard_callback_metrics_and_validate(run):
    acc = run["events"]
    for k, v in EXPECTED_VAL.items():
        values = [e.value for e in acc.Scalars(k)]
        # one validation per fit epoch (sanity check discarded) + trainer.validate
        assert len(values) == 4, k
        assert values == pytest.approx([v] * 4, rel=1e-6), k
        assert run["fit"][k] == pytest.approx(v, rel=1e-6), k
        assert run["validate"][k] == pytest.approx(v, rel=1e-6), k


def test_prompts_new_and_distinct_count_across_epochs_and_a_resume(tmp_path):
    def step(epoch, ids):
        trees = build_trees()
        for t, i in zip(trees, ids, strict=True):
            t.tree_id = i
        return build_step(epoch, trees=trees)

    cb = AllocationSpread(histograms=False)
    steps = [step(0, ["q-a", "q-b", "q-c"]), step(1, ["q-d", "q-b", "q-c"]),
             step(2, ["q-a", "q-e", "q-f"])]
    t = trainer(tmp_path / "a", [cb], max_epochs=3)
    t.fit(TinyModule(), datamodule=StepData(steps))
    acc = read_events(t.logger.log_dir)
    assert [e.value for e in acc.Scalars("alloc/prompts_new")] == [3, 1, 2]
    assert [e.value for e in acc.Scalars("alloc/prompts_distinct")] == [3, 4, 6]
    assert cb.state_dict() == {"seen": ["q-a", "q-b", "q-c", "q-d", "q-e", "q-f"]}
    # restored, a later epoch counts on from the six: q-a is not new, q-g is
    resumed = AllocationSpread(histograms=False)
    resumed.load_state_dict(cb.state_dict())
    t = trainer(tmp_path / "b", [resumed], max_epochs=1)
    t.fit(TinyModule(), datamodule=StepData([step(0, ["q-a", "q-g", "q-b"])]))
    acc = read_events(t.logger.log_dir)
    assert [e.value for e in acc.Scalars("alloc/prompts_new")] == [1]
    assert [e.value for e in acc.Scalars("alloc/prompts_distinct")] == [7]


# ---- boundary checks -----------------------------------------------------------------------
@pytest.mark.parametrize("callback", [AllocationSpread(), PredictorCalibration(), TreeSamples()])
@pytest.mark.parametrize("logger", [False, "csv"])
def test_missing_tensorboard_logger_fails_at_setup(tmp_path, callback, logger):
    if logger == "csv":
        logger = CSVLogger(str(tmp_path))
    dm = StepData([build_step(0)])
    with pytest.raises(ValueError, match="TensorBoardLogger") as e:
        trainer(tmp_path, [callback], logger=logger).fit(TinyModule(), datamodule=dm)
    assert "trainer.logger" in str(e.value)
    assert dm.last_step is None  # failed before the first rollout


def test_scalar_callbacks_accept_any_logger_but_not_none(tmp_path):
    dm = StepData([build_step(0)])
    t = trainer(tmp_path, [RewardVariance(), Throughput(), AllocationSpread(histograms=False),
                           PredictorCalibration(diagram=False)], logger=CSVLogger(str(tmp_path)))
    t.fit(TinyModule(), datamodule=dm)
    lines = (Path(t.logger.log_dir) / "metrics.csv").read_text()
    assert "rollout/effective_ratio" in lines and "alloc/root_gini" in lines
    with pytest.raises(ValueError, match="no logger"):
        trainer(tmp_path, [RewardVariance()], logger=False).fit(TinyModule(), datamodule=dm)


def test_wrong_datamodule_fails_at_setup(tmp_path):
    class Plain(L.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(torch.zeros(2, 1), batch_size=1)

    with pytest.raises(ValueError, match="TraceDataModule"):
        trainer(tmp_path, [RewardVariance()]).fit(TinyModule(), datamodule=Plain())


def test_qa_accuracy_reports_only_the_sets_of_this_validation(tmp_path):
    """Validating on fewer sets than the fit did logs nothing for the missing ones."""
    qa = QAAccuracy()
    t = trainer(tmp_path, [qa])
    t.fit(TinyModule(), datamodule=StepData([build_step(0)]))
    assert any(k.startswith("val/nq/") for k in qa.last_metrics)
    (got,) = t.validate(TinyModule(), verbose=False, datamodule=StepData(
        [build_step(0)], val_rows={"hotpotqa": VAL_ROWS["hotpotqa"]}))
    assert not [k for k in got if k.startswith("val/nq/")], got
    assert got["val/em"] == got["val/hotpotqa/em"]


def test_qa_accuracy_rejects_a_validation_step_without_the_batch(tmp_path):
    class NoOutputs(TinyModule):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            return None

    with pytest.raises(ValueError, match="validation_step to return the batch"):
        trainer(tmp_path, [QAAccuracy()]).validate(NoOutputs(), datamodule=StepData([]))


# ---- two processes -------------------------------------------------------------------------
DDP_SCRIPT = r'''
import json, sys
import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from callbacks import QAAccuracy, RewardVariance
from builders.steps import StepData, TinyModule, build_step, build_trees

def row(ds, em):
    return dict(dataset=ds, em=em, f1=em, reward=em, searches=1.0, malformed=0.0)

class RankData(StepData):
    """Rank 0: trees A, B; 2 hotpotqa + 1 nq questions. Rank 1: tree C; 4 + 2 questions."""
    def train_dataloader(self):
        a, b, c = build_trees()
        rank = self.trainer.global_rank
        self.steps = [build_step(0, trees=[a, b] if rank == 0 else [c])]
        return super().train_dataloader()
    def val_dataloader(self):
        if self.trainer.global_rank == 0:
            self.val_rows = {"hotpotqa": [row("hotpotqa", 1.0)] * 2, "nq": [row("nq", 1.0)]}
        else:
            self.val_rows = {"hotpotqa": [row("hotpotqa", x) for x in (0.0, 0.0, 0.0, 1.0)],
                             "nq": [row("nq", 0.0)] * 2}
        return super().val_dataloader()

if __name__ == "__main__":
    out = sys.argv[1]
    t = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1,
                  logger=TensorBoardLogger(out, name="tb", version=0),
                  callbacks=[RewardVariance(), QAAccuracy()], use_distributed_sampler=False,
                  reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, log_every_n_steps=1)
    dm, model = RankData([]), TinyModule()
    t.fit(model, datamodule=dm)
    fit = {k: float(v) for k, v in t.callback_metrics.items()}
    validated = t.validate(model, datamodule=dm, verbose=False)[0]
    if t.global_rank == 0:
        with open(f"{out}/result.json", "w") as f:
            json.dump({"fit": fit, "validate": validated, "log_dir": t.logger.log_dir}, f)
'''


def test_two_processes_reduce_over_the_union_of_examples(tmp_path):
    """Two CPU processes (gloo), started side by side as torchrun would (Lightning sees
    LOCAL_RANK and joins them instead of re-launching the script one after the other)."""
    script = tmp_path / "ddp_script.py"
    script.write_text(DDP_SCRIPT)
    for r, (rc, out) in enumerate(run_ranks(script, [str(tmp_path)], tmp_path)):
        assert rc == 0, f"rank {r} failed:\n{out[-4000:]}"
    res = json.loads((tmp_path / "result.json").read_text())
    # union: hotpotqa (1+1+0+0+0+1)/6 = .5 (a mean of the ranks' means: (1 + .25)/2 = .625);
    # nq (1+0+0)/3 (mean of means .5); val/em = (.5 + 1/3) / 2
    expected = {"val/hotpotqa/em": 0.5, "val/nq/em": 1 / 3, "val/em": (0.5 + 1 / 3) / 2,
                "val/hotpotqa/questions": 6, "val/nq/questions": 3}
    for k, v in expected.items():
        assert res["fit"][k] == pytest.approx(v), k
        assert res["validate"][k] == pytest.approx(v), k
    acc = read_events(res["log_dir"])
    # trees split {A, B} / {C}: the merged statistics equal the one-process ones
    for k in ("rollout/effective_ratio", "rollout/zero_std_share_bare", "rollout/reward_mean",
              "rollout/informative_leaf_share", "rollout/prompt_reward_std_mean"):
        assert _first(acc, k) == pytest.approx(EXPECTED_ROLLOUT[k], rel=1e-5), k
    assert math.isclose(_first(acc, "val/em"), (0.5 + 1 / 3) / 2, rel_tol=1e-6)
