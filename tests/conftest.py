"""Shared fixtures: the real QA data beside the checkout, the small demo world, the tiny
policy's weights, and the environment every test leaves as it found it. Builders (plain
functions) are in ``builders``; fixtures of one folder's tests in that folder's conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    """``$TRACE_SHARED_DATA`` or ``../shared/data`` beside the checkout."""
    return Path(os.environ.get("TRACE_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "hotpotqa" / "dev_distractor.jsonl").exists():
        pytest.fail(f"real QA data not found at {path}; set TRACE_SHARED_DATA to the folder "
                    f"that holds hotpotqa/, 2wikimultihopqa/, nq/ and wiki18/")
    return path


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """The small demo world (``builders.SMALL_DEMO``), prepared once per session."""
    from builders import small_demo

    return small_demo(tmp_path_factory.mktemp("demo") / "world")


@pytest.fixture(scope="module")
def model_state():
    """The tiny random-weight Qwen3's state dict, of ``builders.trees.HAND_VOCAB`` tokens (the
    hand-built trees' ids): ``builders.models.policy`` loads it (float64 by default)."""
    from builders.models import tiny_qwen3_state
    from builders.trees import HAND_VOCAB

    return tiny_qwen3_state(HAND_VOCAB)


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves ``os.environ`` as it found it. Lightning's in-process FSDP and DDP
    set MASTER_ADDR, MASTER_PORT, NODE_RANK and LOCAL_RANK there; a later test's
    ``trace-lightning fit --trainer.devices=2`` subprocess inherited them, took itself for
    an already launched rank 0 and waited for a rank 1 that was never started."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
