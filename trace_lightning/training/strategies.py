"""FSDP strategies: Lightning's, with fp32 where RL needs it, and the same on CPU processes.

``TraceFSDPStrategy`` is Lightning's ``FSDPStrategy`` (FSDP1) except under a ``*-mixed``
precision: Lightning's plugin then casts FSDP's buffers and gradient reductions to the
low-precision dtype too. Buffers include RoPE's ``inv_freq`` (Qwen3's), which is rounded
once, for good: bf16's 3.7e-3 relative error on a frequency is a 1-radian phase error
1,000 tokens apart, so the trainer's log-probs on long trajectories drift from vLLM's (which
keeps it in fp32) and on-policy ratios are off 1. Here buffers stay fp32 and gradients are
reduced in fp32 (as verl's FSDP workers do); parameters compute in the low dtype on fp32
masters. An explicit ``mixed_precision`` argument wins, as in Lightning.

``CPUFSDPStrategy`` runs that path on CPU processes. Lightning's ``FSDPStrategy`` refuses the
CPU accelerator (by exact type), and FSDP needs ``device_id=cpu`` there where Lightning
passes the device index (None on CPU). This subclass fixes both and otherwise is the
strategy above: the same FSDP1 wrapping, state-dict types and checkpoints, over gloo. It is
for checking a sharded setup (wrapping, weight sync, sharded checkpoints, export) before it
meets a GPU node, not for speed::

    trace-lightning fit --config configs/demo.yaml --trainer.devices=2 \\
        --trainer.strategy=trace_lightning.training.strategies.CPUFSDPStrategy
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision


class TraceFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy``, takes its arguments; under ``bf16-mixed`` or ``16-mixed``
    buffers stay fp32 and gradients are reduced in fp32 (see the module docstring)."""

    @property
    def mixed_precision_config(self) -> MixedPrecision | None:
        config = super().mixed_precision_config
        if (self.mixed_precision is None and config is not None
                and str(self.precision_plugin.precision).endswith("-mixed")):
            return MixedPrecision(param_dtype=config.param_dtype, reduce_dtype=torch.float32,
                                  buffer_dtype=torch.float32)
        return config


class CPUFSDPStrategy(TraceFSDPStrategy):
    """``TraceFSDPStrategy`` (FSDP1) on CPU processes over gloo; takes its arguments."""

    def _fsdp_kwargs(self) -> dict:
        return dict(cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy,
                    device_id=torch.device("cpu"), **self.kwargs)

    def _setup_model(self, model):
        # Lightning's, with device_id=cpu: wrap (unless configure_model did), then
        # activation checkpointing, which must come after the wrapping
        if any(isinstance(m, FSDP) for m in model.modules()):
            self.kwargs.pop("auto_wrap_policy", None)
        else:
            model = FSDP(module=model, **self._fsdp_kwargs())
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    @contextlib.contextmanager
    def model_sharded_context(self):
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(wrapper_cls=FSDP, **self._fsdp_kwargs()):
            yield
