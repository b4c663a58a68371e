"""What a user sees when a run cannot start: an error is one line (parse errors without
jsonargparse's 90 lines of usage, setup errors without Lightning's traceback;
``TRACE_LIGHTNING_DEBUG=1`` shows both), a YAML error names its file, and a failed run leaves
no empty log folder behind. Real CLI, real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trace_lightning.cli import main, remove_unused_log_dir

SEARCH_QA = "trace_lightning.tasks.search_qa.SearchQAData"  # --data.task of search QA

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")


def test_a_parse_error_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("TRACE_LIGHTNING_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", DEMO, "--data.allocator.kind=nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: Parser key \"data.allocator.kind\": Expected a typing.Literal['uniform', "
        "'random_tree', 'prompt', 'prefix', 'trace', 'oracle']. Got value: nope"]
    monkeypatch.setenv("TRACE_LIGHTNING_DEBUG", "1")
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEMO, "--data.allocator.kind=nope"])
    err = capsys.readouterr().err
    assert "usage:" in err and err.splitlines()[-1].startswith("error: Parser key")


def test_a_yaml_error_names_its_file_and_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRACE_LIGHTNING_DEBUG", raising=False)
    bad = tmp_path / "mine.yaml"
    bad.write_text("trainer:\n  max_epochs: 2\n  devices: [1, 2\nmodel:\n  lr: 1.0\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", DEMO, "--config", str(bad)])
    assert capsys.readouterr().err.splitlines() == [
        f"error: {bad}, line 4, column 6: did not find expected ',' or ']' (while parsing a "
        f"flow sequence at line 3, column 12); the file is not valid YAML"]


def _run_args(root: Path) -> list[str]:
    """A validate run without the demo that fails in the DataModule's setup (after the
    logger made its folder): its checkpoint is no checkpoint."""
    policy = root / "policy"
    policy.mkdir()
    (policy / "config.json").write_text("{}")
    (policy / "tokenizer.json").write_text("{}")
    (root / "train.jsonl").write_text(json.dumps({"id": "0", "question": "q", "answers": ["a"]}))
    (root / "corpus.jsonl").write_text(json.dumps({"id": "0", "title": "t", "text": "x y"}))
    (root / "junk.ckpt").write_text("not a checkpoint\n")
    return [f"--model.policy_path={policy}", f"--data.task={SEARCH_QA}",
            f"--data.task.init_args.train={root / 'train.jsonl'}",
            f"--data.task.init_args.corpus={root / 'corpus.jsonl'}", "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={root / 'run'}", f"--ckpt_path={root / 'junk.ckpt'}"]


def test_a_setup_error_is_one_line_and_leaves_no_log_folder(tmp_path, capsys, monkeypatch):
    """From the console script: the error's one line, exit status 1 (it printed a 15-51-line
    traceback first); the ``version_0`` the logger made at setup is gone, a folder that was
    there before is kept. With ``TRACE_LIGHTNING_DEBUG=1`` the hook ``main`` installs hands
    the error to Python's, which prints the traceback."""
    args = _run_args(tmp_path)
    kept = tmp_path / "run" / "lightning_logs" / "version_0"
    kept.mkdir(parents=True)
    (kept / "notes.txt").write_text("mine")
    command = [str(Path(sys.executable).with_name("trace-lightning")), "validate", *args]
    env = {k: v for k, v in os.environ.items() if k != "TRACE_LIGHTNING_DEBUG"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [done.stderr.splitlines()[-1]]
    assert errors[0].startswith(f"error: ValueError: --ckpt_path: {tmp_path / 'junk.ckpt'} "
                                f"does not load as a checkpoint")
    assert errors[0].endswith("(TRACE_LIGHTNING_DEBUG=1 prints the traceback)")
    assert sorted(p.name for p in (tmp_path / "run" / "lightning_logs").iterdir()) == \
        ["version_0"]  # version_1 was this run's
    assert (kept / "notes.txt").read_text() == "mine"

    # in this process: the error main raises, through the hook it installed
    monkeypatch.setenv("TRACE_LIGHTNING_DEBUG", "1")
    with pytest.raises(ValueError, match="--ckpt_path: ") as raised:
        main(["validate", *args])
    capsys.readouterr()
    sys.excepthook(raised.type, raised.value, raised.tb)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    # (after an in-process fit, torch's rank prefix may lead each line: "[rank0]: ")
    assert "ValueError: --ckpt_path: " in err.splitlines()[-1]


def test_a_failed_run_removes_only_a_log_folder_it_wrote_nothing_into(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    def version(name: str, scalar: bool = False, other: str | None = None) -> Path:
        folder = tmp_path / name / "tb" / "version_0"
        writer = SummaryWriter(str(folder))
        if scalar:
            writer.add_scalar("train/loss", 1.0, 0)
        writer.close()
        (folder / "config.yaml").write_text("trainer: {}\n")
        if other:
            (folder / other).write_text("")
        return folder

    unused = version("unused")
    remove_unused_log_dir(unused, top=unused.parent)  # tb/ was made by the run too
    assert not unused.parent.exists() and (tmp_path / "unused").is_dir()
    for folder in (version("logged", scalar=True), version("notes", other="notes.txt")):
        remove_unused_log_dir(folder, top=folder.parent)
        assert folder.is_dir() and (folder / "config.yaml").is_file()
