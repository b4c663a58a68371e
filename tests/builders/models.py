"""The tiny random-weight Qwen3 (``trace_lightning.models.tiny_qwen3_config``) the tests of
packing and training run: saved to a folder, as a state dict, or loaded in float64."""

from __future__ import annotations

import types
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from trace_lightning.models import tiny_qwen3_config
from trace_lightning.packing.attention import TREE_SDPA


def tiny_qwen3_dir(path: Path, vocab_size: int) -> Path:
    """The tiny Qwen3 of ``vocab_size`` tokens (seed 0) saved to ``path``, no tokenizer."""
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size)).save_pretrained(path)
    return path


def tiny_qwen3_state(vocab_size: int) -> dict[str, torch.Tensor]:
    """The tiny Qwen3 of ``vocab_size`` tokens (seed 0), as a state dict."""
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_qwen3_config(vocab_size)).state_dict()


def _rms_norm_in_float64(self, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm in the input's dtype: transformers' computes in float32 whatever the
    input, which caps a float64 comparison at float32 precision (gradients of a shared token
    summed before the norm's float32 backward, or after it per leaf, differ by 1e-7)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def in_float64(model):
    """``model`` in float64 throughout, its RMS norms included, in train mode."""
    for mod in model.modules():
        if isinstance(mod, Qwen3RMSNorm):
            mod.forward = types.MethodType(_rms_norm_in_float64, mod)
    return model.double().train()


def policy(model_state, dtype=torch.float64, attention: str = TREE_SDPA):
    """The tiny policy of ``model_state`` (``tiny_qwen3_state``); ``attention`` TREE_SDPA
    (per node, the default off CUDA) or "sdpa" (a dense 4D mask over the packed row)."""
    vocab = model_state["model.embed_tokens.weight"].shape[0]
    m = Qwen3ForCausalLM(tiny_qwen3_config(vocab, attn_implementation=attention))
    m.load_state_dict(model_state)
    return in_float64(m) if dtype == torch.float64 else m.to(dtype).train()
