"""Fixtures of the training tests: the tiny policy they train, and the process group
Lightning leaves behind."""

from __future__ import annotations

import pytest
import torch

from builders.models import tiny_qwen3_dir
from builders.trees import TINY_VOCAB


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The tiny random-weight Qwen3 (``TINY_VOCAB`` tokens, seed 0), saved without a
    tokenizer (the training step reads token ids only)."""
    return tiny_qwen3_dir(tmp_path_factory.mktemp("policy"), TINY_VOCAB)


@pytest.fixture
def no_process_group():
    """Lightning leaves its process group behind; later tests start their own."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
