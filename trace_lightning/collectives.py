"""Collectives the module and the data module share: every rank's objects, rank 0's object.

The gathers return their input on one process (``trainer`` None or ``world_size`` 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_list(items: list, trainer) -> list:
    """Every rank's ``items``, concatenated in rank order."""
    if trainer is None or trainer.world_size == 1:
        return items
    parts = [None] * trainer.world_size
    dist.all_gather_object(parts, items)
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
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over the ranks (a collective; ``device`` is the process's own, a CUDA
    one under NCCL)."""
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]
