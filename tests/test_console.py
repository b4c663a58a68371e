"""What a user sees: a first run's console says what is happening (the demo world's stages,
where the logs go, one line per epoch with the RL figures, where the trained policy is) and
holds no vLLM INFO line nor a known-benign warning; ``VLLM_LOGGING_LEVEL`` still shows
vLLM's own lines when set."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from callbacks import QAAccuracy, RewardVariance, RLProgressBar
from builders import demo_args

REPO = Path(__file__).resolve().parents[1]
VLLM_LINE = re.compile(r"\b(INFO|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[")  # vLLM's log format


def console_lines(text: str) -> list[str]:
    """What a terminal shows of ``text`` once done: each line's last carriage-return
    segment (a redrawn progress bar leaves its final state), empty lines dropped."""
    lines = (line.split("\r")[-1].strip() for line in text.split("\n"))
    return [line for line in lines if line]


def test_console_lines_keep_a_bars_last_state():
    assert console_lines("a\nRollout 0:  10%\rRollout 0: 100%\n\r   \r\nb\n") == \
        ["a", "Rollout 0: 100%", "b"]


def test_progress_bar_carries_the_rl_figures():
    """The bar shows the step's reward and effective ratio and the last held-out accuracy
    (from the callbacks that compute them), and not the log folder's version."""
    # the task's metrics (search QA's), as QAAccuracy reads them at the first validation
    reward, accuracy, bar = RewardVariance(), QAAccuracy(overall=("em", "f1")), RLProgressBar()
    trainer = Trainer(callbacks=[reward, accuracy, bar], logger=False,
                      enable_checkpointing=False, accelerator="cpu")
    assert bar.rl_figures(trainer) == {}  # nothing computed yet
    reward.last_metrics = {"rollout/reward_mean": 0.3125, "rollout/effective_ratio": 0.4667}
    accuracy.last_metrics = {"val/em": 0.4575, "val/demo_heldout/em": 0.4575}
    assert bar.rl_figures(trainer) == {"reward": "0.312", "effective": "0.47",
                                       "held-out em": "0.4575"}
    metrics = bar.get_metrics(trainer, None)
    assert "v_num" not in metrics and metrics["held-out em"] == "0.4575"


@pytest.mark.slow
def test_first_run_console_says_what_happens_and_nothing_else(tmp_path):
    """``trace-lightning fit`` as a user starts it (its console script, output to a file):
    the world is built here, so its stages show too."""
    world = tmp_path / "world"
    args = demo_args(world, tmp_path, 2)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_LOGGING_LEVEL", "TRACE_LIGHTNING_DEBUG")}
    script = Path(sys.executable).parent / "trace-lightning"
    proc = subprocess.run([str(script), "fit", *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    lines = console_lines(proc.stdout)
    shown = "\n".join(lines)
    assert proc.returncode == 0, shown[-3000:]

    assert not [line for line in lines if VLLM_LINE.search(line)], shown
    for benign in ("Failed to load weights", "chunked prefill", "LD_PRELOAD",
                   "set_num_threads", "is deprecated"):
        assert benign not in shown, benign

    def index(pattern: str) -> int:
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        assert hits, f"no line matching {pattern!r} in:\n{shown}"
        return hits[0]

    # where the logs go, the world's stages in order, the epochs and the policy
    order = [index(p) for p in (
        rf"logs: {re.escape(str(tmp_path))}/tensorboard/version_0",
        rf"building the demo world in {re.escape(str(world))}", r"1/4 corpus: ",
        r"2/4 tokenizer: ", r"3/4 policy: ", r"4/4 warm start: ",
        r"demo world ready in .*warm-start loss \d\.\d{3}",
        r"epoch 1/2: reward \d\.\d{3}, effective \d\.\d\d, held-out em \d\.\d{4}",
        r"epoch 2/2: reward", r"trained policy .*: .*version_0/policy/last")]
    assert order == sorted(order), shown
    assert re.search(rf"watch them: \S*tensorboard --logdir {re.escape(str(tmp_path))}$",
                     lines[order[0] + 1]), lines[order[0] + 1]
    assert (tmp_path / "tensorboard" / "version_0" / "policy" / "last" / "config.json").is_file()
    # an epoch is a few lines besides its progress bars
    epoch_2 = [line for line in lines[order[7] + 1:order[8]]
               if not line.startswith(("Rollout", "Validation", "Epoch"))]
    assert len(epoch_2) <= 3, epoch_2


@pytest.mark.parametrize("level", [None, "INFO"])
def test_vllm_logs_are_quiet_unless_asked_for(level):
    """Without ``VLLM_LOGGING_LEVEL`` vLLM's console shows its warnings but the benign ones,
    and no INFO line, from its import through an engine's start (simulated by vLLM's own
    ``configure_logging``, which the start calls); set, vLLM shows all at that level."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    if level:
        env["VLLM_LOGGING_LEVEL"] = level
    code = ("from trace_lightning.rollout.engines import vllm_console, vllm_engine\n"
            "from vllm.config.logging import LoggingConfig\n"
            "from vllm.logger import configure_logging, init_logger\n"
            "configure_logging(LoggingConfig(log_level='" + (level or "WARNING") + "'))\n"
            "vllm_console.hide_benign()  # what the engine's start does after vLLM's\n"
            "log = init_logger('vllm.probe')\n"
            "log.info('probe: an INFO line')\n"
            "log.warning('RotaryEmbedding: Failed to load weights')\n"
            "log.warning('probe: another warning')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    err = proc.stdout  # vLLM's console is stdout by default, the last-resort one stderr
    assert proc.returncode == 0, err
    assert "probe: another warning" in err
    if level:
        assert "probe: an INFO line" in err and "Failed to load weights" in err
    else:
        assert "probe: an INFO line" not in err and "Failed to load weights" not in err
        assert not VLLM_LINE.search(err), err  # nothing at INFO from the import either
        assert "Triton" not in err, err  # a benign warning vLLM gives while imported


def test_benign_vllm_warnings_are_hidden_and_said_once(caplog):
    from trace_lightning.rollout.engines.vllm_console import BENIGN_VLLM_WARNINGS, HideBenign

    hide = HideBenign()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, message, None, None)

    with caplog.at_level(logging.INFO, logger="trace_lightning"):
        assert hide.filter(record("The KV cache is full")) is True  # not known: shown
        for text, _why in BENIGN_VLLM_WARNINGS:
            assert hide.filter(record(f"[x.py:1] {text} (detail)")) is False
    told = [r for r in caplog.records if "known-benign warnings" in r.getMessage()]
    assert len(told) == 1 and "docs/vllm.md" in told[0].getMessage()


def test_docs_explain_every_hidden_warning():
    from trace_lightning.rollout.engines.vllm_console import BENIGN_VLLM_WARNINGS

    doc = (REPO / "docs" / "vllm.md").read_text().replace("`", "")
    missing = [text for text, _ in BENIGN_VLLM_WARNINGS if text.replace("`", "") not in doc]
    assert not missing, f"docs/vllm.md does not explain these hidden warnings: {missing}"
