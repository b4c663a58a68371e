"""FSDP on CPU: the GPU configs' sharded training path, runnable on a machine without a GPU.

Lightning's ``FSDPStrategy`` refuses the CPU accelerator (by exact type), and FSDP needs
``device_id=cpu`` there where Lightning passes the device index (None on CPU). This subclass
fixes both and otherwise is Lightning's strategy: the same FSDP1 wrapping, state-dict types
and checkpoints, over gloo. It is for checking a sharded setup (wrapping, weight sync,
sharded checkpoints, export) before it meets a GPU node, not for speed::

    trace-lightning fit --config configs/demo.yaml --trainer.devices=2 \\
        --trainer.strategy=trace_lightning.strategies.CPUFSDPStrategy
"""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) on CPU processes over gloo; takes its arguments."""

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
