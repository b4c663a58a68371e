"""Shared fixtures: the real QA data beside the checkout, and hermetic tiny models."""

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
