"""Collectives the module and the data module share: every rank's objects, rank 0's object,
and failing together.

These carry small Python objects and flags, not tensors of the model, so they run on the CPU
over a gloo group (``cpu_group``) whatever the trainer's backend: under NCCL they take no GPU
round trip, and a process whose CUDA context is broken (a sticky CUDA error: an illegal memory
access in a kernel) can still tell the others it failed instead of leaving them waiting in an
all-reduce on the GPU until the process group's timeout.

The gathers return their input on one process (``trainer`` None or ``world_size`` 1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


_cpu_group: tuple[object, object] | None = None  # (the default group, its gloo group)


def cpu_group():
    """A gloo group of every process, for the collectives below: the default group when it
    is gloo, else one created for it (once per default group; a collective, so every process
    calls it at the same point, which the callers below ensure by calling it first)."""
    global _cpu_group
    world = dist.group.WORLD
    if dist.get_backend(world) == dist.Backend.GLOO:
        return world
    if _cpu_group is None or _cpu_group[0] is not world:
        _cpu_group = (world, dist.new_group(backend="gloo"))
    return _cpu_group[1]


def all_gather_list(items: list, trainer) -> list:
    """Every rank's ``items``, concatenated in rank order."""
    if trainer is None or trainer.world_size == 1:
        return items
    parts = [None] * trainer.world_size
    dist.all_gather_object(parts, items, group=cpu_group())
    return [x for part in parts for x in part]


def all_gather_batch(batch, trainer):
    """Concatenate every rank's predictor entries (each rank then trains identically)."""
    if trainer is None or trainer.world_size == 1:
        return batch
    parts = all_gather_list([tuple(t.cpu() for t in batch)], trainer)
    # a rank that opened no prompt has no nodes, and no feature width: leave it out
    parts = [p for p in parts if len(p[0])] or parts[:1]
    return type(batch)(*(torch.cat(ts) for ts in zip(*parts)))


def from_rank0(obj):
    """Rank 0's ``obj`` on every rank (a collective)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]


def any_rank(flags: list[bool]) -> list[bool]:
    """Each flag OR-ed over the ranks (a collective, on the CPU)."""
    group = cpu_group()
    t = torch.tensor([int(f) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(x) for x in t.tolist()]


class RankFailed(RuntimeError):
    """Another process failed; this one stops with it (the error is in that process's log)."""


def raise_together(error: Exception | None, any_failed: Callable[[bool], bool] | None,
                   what: str) -> None:
    """After work that can fail on one process alone (its files, its engine, its retriever's
    requests): every process raises when any failed, the one that failed its own ``error``,
    the others ``RankFailed``, instead of going on to wait for it in their next collective
    (until the process group's timeout, with ranks that torchrun or srun started).

    ``any_failed(flag)``: the flag OR-ed over the processes (a collective every process
    calls); None on one process.
    """
    failed = error is not None
    if any_failed is not None:
        if error is not None:
            log_failure(error, what)
        failed = any_failed(failed)
    if failed:
        raise_failed(error, what)


def log_failure(error: Exception, what: str) -> Exception:
    """Log this process's ``error`` before the processes agree on it: it is in this log even
    if another process never comes to agree (stuck in some other collective)."""
    log.error("%s failed on this process (%s: %s); telling the others", what,
              type(error).__name__, error)
    return error


def raise_failed(error: Exception | None, what: str) -> None:
    """Stop after the processes agreed that one failed ``what``: the one that failed raises
    its own ``error``, the others (``error`` None) ``RankFailed``."""
    if error is not None:
        raise error
    raise RankFailed(f"another process failed {what}; its log has the error, and this "
                     f"process stops with it")


@contextlib.contextmanager
def fail_together(what: str, any_failed: Callable[[bool], bool] | None) -> Iterator[None]:
    """``raise_together`` around a block that runs no collective itself: one that failed on
    one process would leave the others waiting in it."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - raised again below, on every process
        error = e
    raise_together(error, any_failed, what)
