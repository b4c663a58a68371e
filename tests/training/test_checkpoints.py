"""Checkpoints a stop or a damaged disk leaves: ``--ckpt_path last`` resumes from the newest
intact one (``cli.last_checkpoint``), and setup names a checkpoint that does not hold what
the run will load (``checkpoints.check_checkpoint``), before the engine starts. Real
Lightning ModelCheckpoint files from a real Trainer on the tiny policy (``policy_dir``,
training/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import Qwen3ForCausalLM

from trace_lightning.cli import last_checkpoint, main
from trace_lightning.training.checkpoints import checkpoint_meta
from trace_lightning.models import tiny_qwen3_config
from trace_lightning.training.module import TraceModule
from builders import REPO
from builders.trees import TINY_VOCAB
from builders.training import cpu_fsdp, fit_checkpointed

SEARCH_QA = "trace_lightning.tasks.search_qa.SearchQAData"  # --data.task of search QA

# A real fit (2 steps an epoch) killed where a kill is worst: Lightning saved the third
# epoch's checkpoint and deleted the second's, and has not yet linked last.ckpt to the new
# one (ModelCheckpoint: _save_topk_checkpoint saves, then removes the previous file;
# _save_last_checkpoint then re-links last.ckpt).
KILLED_FIT = """
import os, sys
from lightning.pytorch.callbacks import ModelCheckpoint
from builders.training import fit_checkpointed
from trace_lightning.training.module import TraceModule


class KilledAfterRemoval(ModelCheckpoint):
    def _remove_checkpoint(self, trainer, filepath):
        super()._remove_checkpoint(trainer, filepath)
        if trainer.current_epoch == 2:
            os._exit(9)

policy, root = sys.argv[1:]
fit_checkpointed(root, TraceModule(policy_path=policy, lr=1e-4), 3,
                 KilledAfterRemoval(dirpath=os.path.join(root, "checkpoints"), save_last="link",
                                    save_top_k=1), batches=2)
"""


@pytest.fixture(scope="module")
def policy(policy_dir, tmp_path_factory) -> Path:
    """The tiny policy (``policy_dir``) with a tokenizer beside it, as the CLI requires (the runs
    here stop before the engine would use it)."""
    from trace_lightning.models import train_tokenizer

    path = tmp_path_factory.mktemp("cli") / "policy"
    shutil.copytree(policy_dir, path)
    train_tokenizer(["a tiny corpus"] * 8, vocab_size=300).save_pretrained(path)
    return path


def _trainer(folder: Path) -> L.Trainer:
    """A trainer whose checkpoints go to ``folder`` (what ``last`` searches)."""
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                     callbacks=[ModelCheckpoint(dirpath=folder)])


def _cut_short(path: Path, keep: float = 0.5) -> None:
    """``path`` as a stop during its write leaves it: its first part."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


@pytest.fixture(scope="module")
def killed_run(policy, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    tests = REPO / "tests"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", KILLED_FIT, str(policy), str(root)],
                          cwd=tests, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-3000:]
    return root / "checkpoints"


def test_last_resumes_the_checkpoint_saved_before_a_kill_left_last_ckpt_dangling(
        killed_run, policy, tmp_path):
    """The kill left last.ckpt linking to the deleted epoch=1 file, beside the intact
    epoch=2 one: ``last`` logged "no last checkpoint" and trained from the initial policy."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for p in killed_run.iterdir():  # a copy, links as links (other tests cut files short)
        if p.is_symlink():
            (folder / p.name).symlink_to(p.readlink())
        else:
            (folder / p.name).write_bytes(p.read_bytes())
            os.utime(folder / p.name, (p.stat().st_atime, p.stat().st_mtime))
    link, newer = folder / "last.ckpt", folder / "epoch=2-step=6.ckpt"
    assert link.is_symlink() and not link.exists()
    assert str(link.readlink()) == "epoch=1-step=4.ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=2-step=6.ckpt", "last.ckpt"]

    found, _, skipped = last_checkpoint(_trainer(folder))
    assert found == newer
    assert len(skipped) == 1 and "last.ckpt (links to epoch=1-step=4.ckpt, which was " \
                                   "deleted)" in skipped[0]
    # it resumes: the fit starts at the checkpoint's step, not at 0
    starts = []

    class Start(L.Callback):
        def on_train_start(self, trainer, pl_module):
            starts.append(trainer.global_step)

    fit_checkpointed(tmp_path, TraceModule(policy_path=str(policy), lr=1e-4), 4, Start(),
                     ckpt=str(found), batches=2)
    assert starts == [6]


def test_last_skips_a_file_cut_short_and_stops_when_none_loads(killed_run, policy,
                                                               tmp_path):
    """A stop while Lightning wrote a checkpoint (it copies it from a temporary file when
    /tmp is another file system) leaves it cut short: the one before is resumed; with no
    checkpoint that loads, ``fit --ckpt_path last`` stops and names them, rather than start
    from the initial policy."""
    folder = tmp_path / "checkpoints"
    fit_checkpointed(tmp_path, TraceModule(policy_path=str(policy), lr=1e-4), 1,
                     ModelCheckpoint(dirpath=folder, save_last="link", save_top_k=1))
    older = folder / "epoch=0-step=1.ckpt"
    cut = folder / "epoch=1-step=2.ckpt"
    cut.write_bytes(older.read_bytes())
    _cut_short(cut)
    later = older.stat().st_mtime + 10
    os.utime(cut, (later, later))
    found, _, skipped = last_checkpoint(_trainer(folder))
    assert found == folder / "last.ckpt" and found.resolve() == older
    assert len(skipped) == 1 and skipped[0].startswith(f"{cut} (it does not load: ")

    # the killed run's folder with its one intact checkpoint cut short: none loads
    (tmp_path / "killed" / "checkpoints").mkdir(parents=True)
    for p in killed_run.iterdir():
        copy = tmp_path / "killed" / "checkpoints" / p.name
        if p.is_symlink():
            copy.symlink_to(p.readlink())
        else:
            copy.write_bytes(p.read_bytes())
            _cut_short(copy)
    train, corpus = _qa_files(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        main(["fit", f"--model.policy_path={policy}", f"--data.task={SEARCH_QA}",
              f"--data.task.init_args.train={train}",
              f"--data.task.init_args.corpus={corpus}", "--trainer.accelerator=cpu",
              "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path / 'killed'}",
              "--ckpt_path=last"])
    message = str(err.value)
    assert message.startswith(f"--ckpt_path last: no checkpoint in {tmp_path / 'killed'}")
    assert "epoch=2-step=6.ckpt (it does not load: " in message
    assert "last.ckpt (links to epoch=1-step=4.ckpt, which was deleted)" in message


def _qa_files(root: Path) -> tuple[Path, Path]:
    train, corpus = root / "train.jsonl", root / "corpus.jsonl"
    train.write_text("".join(f'{{"id": "{i}", "question": "q{i}", "answers": ["a"]}}\n'
                             for i in range(80)))
    corpus.write_text('{"id": "0", "title": "Paris", "text": "Paris is in France."}\n')
    return train, corpus


@pytest.fixture(scope="module")
def trained(policy, tmp_path_factory) -> Path:
    """A checkpoint of one epoch of two steps (AdamW moments for every parameter)."""
    root = tmp_path_factory.mktemp("trained")
    trainer = fit_checkpointed(root, TraceModule(policy_path=str(policy), lr=1e-4), 1,
                               ModelCheckpoint(dirpath=root), batches=2)
    return Path(trainer.checkpoint_callback.best_model_path)


def _flip(path: Path, tensor: torch.Tensor, length: int = 4096) -> None:
    """Invert ``length`` bytes of ``tensor``'s data in the file ``path`` (from its middle):
    damage a save's CRC-32 would show, which torch.load does not check."""
    data = bytearray(path.read_bytes())
    raw = tensor.contiguous().numpy().tobytes()
    start = data.find(raw)
    assert start >= 0 and data.count(raw) == 1 and len(raw) >= 2 * length
    for i in range(start + len(raw) // 4, start + len(raw) // 4 + length):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_optimizer_state_is_named_at_setup_before_the_engine(trained, policy,
                                                                       tmp_path):
    """4 KB of an AdamW moment inverted on disk loaded silently (the run rolled out an epoch
    and failed 72 s later); now the fit stops in setup, naming the file and the entry, and
    leaves no empty log folder. (The engine would start after the check: on this tokenizer-
    less policy it would fail with another error.)"""
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(trained.read_bytes())
    saved = torch.load(trained, weights_only=False)
    _flip(flipped, saved["optimizer_states"][0]["state"][0]["exp_avg_sq"])
    reloaded = torch.load(flipped, weights_only=False)  # what Lightning would load
    assert (reloaded["optimizer_states"][0]["state"][0]["exp_avg_sq"] < 0).any()

    train, corpus = _qa_files(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        main(["fit", f"--model.policy_path={policy}", f"--data.task={SEARCH_QA}",
              f"--data.task.init_args.train={train}",
              f"--data.task.init_args.corpus={corpus}", "--trainer.accelerator=cpu",
              f"--trainer.default_root_dir={run}", f"--ckpt_path={flipped}"])
    assert str(err.value).startswith(
        f"--ckpt_path: {flipped} is damaged: optimizer_states[0]['state'][0]['exp_avg_sq'] "
        f"(record archive/data/")
    assert "differs from what was saved (Bad CRC-32" in str(err.value)
    assert not run.exists()  # the logger's version_0, created at setup, is removed again

    # validate loads the weights only: their records are intact
    meta = checkpoint_meta(flipped)
    TraceModule(policy_path=str(policy)).check_checkpoint(flipped, meta, str(policy),
        fitting=False)


def test_a_file_that_does_not_unpickle_is_one_error_naming_it(trained, policy,
                                                             tmp_path):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(trained.read_bytes())
    _cut_short(cut, keep=0.9)
    train, corpus = _qa_files(tmp_path)
    with pytest.raises(ValueError, match=rf"^--ckpt_path: {cut} does not load as a checkpoint"):
        main(["validate", f"--model.policy_path={policy}", f"--data.task={SEARCH_QA}",
              f"--data.task.init_args.train={train}",
              f"--data.task.init_args.corpus={corpus}", "--trainer.accelerator=cpu",
              "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
              f"--ckpt_path={cut}"])


@pytest.mark.parametrize("where, value, fitting, message", [
    # a run that diverged saves NaN weights (CRCs and all)
    (lambda c: c["state_dict"]["policy.model.norm.weight"], float("nan"), False,
     "state_dict['policy.model.norm.weight'] holds 1 non-finite (NaN or inf) values of 64"),
    (lambda c: c["trace"]["replay"]["steps"][0]["value"], float("inf"), True,
     "trace['replay']['steps'][0]['value'] holds 1 non-finite (NaN or inf) values of 3"),
    # a mean of squares is never negative
    (lambda c: c["optimizer_states"][0]["state"][1]["exp_avg_sq"], -1.0, True,
     "optimizer_states[0]['state'][1]['exp_avg_sq'] (the AdamW state of "
     "policy.model.layers.0.self_attn.q_proj.weight) holds 1 negative values of 8192"),
    (lambda c: c["optimizer_states"][0]["state"][1]["exp_avg"], float("nan"), True,
     "optimizer_states[0]['state'][1]['exp_avg'] (the AdamW state of "
     "policy.model.layers.0.self_attn.q_proj.weight) holds 1 non-finite"),
    # validate loads no optimizer state: not checked
    (lambda c: c["optimizer_states"][0]["state"][1]["exp_avg_sq"], -1.0, False, None),
])
def test_a_saved_value_that_cannot_be_right_is_named(trained, policy, tmp_path,
                                                     where, value, fitting, message):
    """Saved so (its CRCs match): the values themselves are checked."""
    checkpoint = torch.load(trained, weights_only=False)
    checkpoint["trace"]["replay"] = {"max_steps": 4,
                                     "steps": [{"value": torch.tensor([0.0, 1.0, 0.5])}]}
    where(checkpoint).view(-1)[0] = value
    path = tmp_path / "bad.ckpt"
    torch.save(checkpoint, path)
    module = TraceModule(policy_path=str(policy))
    if message is None:
        module.check_checkpoint(path, checkpoint_meta(path), str(policy), fitting)
        return
    with pytest.raises(ValueError) as err:
        module.check_checkpoint(path, checkpoint_meta(path), str(policy), fitting)
    assert str(err.value).startswith(f"--ckpt_path: {path}: {message}")


def test_a_checkpoint_of_another_model_is_named_by_its_keys_and_shapes(trained, policy,
                                                                      tmp_path):
    """Lightning's strict load would fail only after the engine started; the expected keys
    and shapes come from models on the meta device."""
    meta = checkpoint_meta(trained)
    TraceModule(policy_path=str(policy)).check_checkpoint(trained, meta, str(policy),
        fitting=True)
    with pytest.raises(ValueError, match=r"does not fit this run's model \(missing: "
                                         r"reference\.model\.embed_tokens\.weight, .* and \d+ "
                                         r"more\); .*--model\.kl_coef 0\.1"):
        TraceModule(policy_path=str(policy), kl_coef=0.1).check_checkpoint(
            trained, meta, str(policy), fitting=False)
    other = tmp_path / "other"
    Qwen3ForCausalLM(tiny_qwen3_config(TINY_VOCAB + 4)).save_pretrained(other)
    with pytest.raises(ValueError, match=rf"other shapes: policy\.model\.embed_tokens\.weight "
                                         rf"\({TINY_VOCAB}, 64\) "
                                         rf"\(this run's: \({TINY_VOCAB + 4}, 64\)\)"):
        TraceModule(policy_path=str(other)).check_checkpoint(trained, meta, str(other),
        fitting=True)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_a_sharded_checkpoint_is_checked_from_its_metadata(policy, tmp_path,
                                                          no_process_group):  # noqa: F811
    trainer = fit_checkpointed(tmp_path, TraceModule(policy_path=str(policy), lr=1e-4), 1,
                               L.Callback(), strategy=cpu_fsdp("sharded"))
    path = Path(trainer.checkpoint_callback.best_model_path)
    assert path.is_dir()
    meta = checkpoint_meta(path)
    TraceModule(policy_path=str(policy)).check_checkpoint(path, meta, str(policy),
        fitting=True)
    with pytest.raises(ValueError, match=r"does not fit this run's model \(missing: reference"):
        TraceModule(policy_path=str(policy), kl_coef=0.1).check_checkpoint(
            path, meta, str(policy), fitting=True)
