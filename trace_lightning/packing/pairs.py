"""The (leaf, token) pairs of a packed micro-batch: a packed tree's shared token stands for
one pair per leaf through it, which a sequence-level weight (rollout correction) needs.

A tree-packed micro-batch lists its pairs (``PAIR_KEYS``: row, position, leaf, advantage;
``leaf_pairs`` per unit, ``collate_pairs`` placed in the batch); a per-leaf micro-batch has
one leaf per row and lists none (``microbatch_pairs`` reads them off its policy tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

PAIR_KEYS = ("pair_row", "pair_pos", "pair_leaf", "pair_adv")


def microbatch_pairs(mb: dict) -> tuple[torch.Tensor, ...]:
    """``(row, pos, leaf, adv)``, ``(P,)`` each: every (leaf, policy token) pair of ``mb``.

    A packed micro-batch lists them (``collate_pairs``); a per-leaf one (``packing.leaves.collate``)
    is one leaf per row: its pairs are its policy tokens, the leaf its row."""
    if "pair_row" in mb:
        return tuple(mb[k] for k in PAIR_KEYS)
    if "subtree_end" in mb:  # packed: a token may stand for several leaves' pairs
        raise ValueError("a packed micro-batch without its (leaf, token) pairs cannot be "
                         "corrected per leaf; build it with packing.trees.tree_minibatches, "
                         "which lists them (collate_pairs)")
    row, pos = (mb["count"] > 0).nonzero(as_tuple=True)  # (P,) each
    return row, pos, row, mb["advantages"][row, pos]


def leaf_pairs(unit, tree, leaves) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(leaf, index, adv)``, ``(P,)`` each, of a ``tree_packing.TreeUnit``: for each of its
    ``leaves`` (0-based, in order), the unit index and advantage of every policy token of its
    root path (as ``packing.trees.leaf_weights`` sums them)."""
    leaf, index, adv = [], [], []
    for j, s in enumerate(leaves):
        path = tree.path(s.leaf_id)
        idx = np.concatenate([np.arange(*unit.spans[p.id]) for p in path])  # (L,)
        m = np.asarray(s.policy_mask, dtype=bool)  # (L,)
        a = np.asarray(s.token_advantages, dtype=np.float32).astype(np.float64)  # (L,)
        index.append(idx[m])
        adv.append(a[m])
        leaf.append(np.full(int(m.sum()), j, dtype=np.int64))
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dtype=dt))
    return cat(leaf, np.int64), cat(index, np.int64), cat(adv, np.float64)


def collate_pairs(units: Sequence, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The pairs of ``units`` (each with ``pairs`` from ``leaf_pairs``) placed at
    ``offsets`` ``(U, 2)`` (their row and first index, ``collate_units``' ``offsets``, in
    the same order); leaves numbered across the micro-batch."""
    rows, pos, leaf, adv = [], [], [], []
    n = 0
    for u, (b, o) in zip(units, offsets.tolist()):
        lf, idx, a = u.pairs
        rows.append(np.full(len(idx), b, dtype=np.int64))
        pos.append(idx + o)
        leaf.append(lf + n)
        adv.append(a)
        n += int(lf.max()) + 1 if len(lf) else 0
    t = (lambda xs, dt: torch.from_numpy(np.concatenate(xs)) if xs
         else torch.zeros(0, dtype=dt))
    return {"pair_row": t(rows, torch.long), "pair_pos": t(pos, torch.long),  # (P,) each
            "pair_leaf": t(leaf, torch.long), "pair_adv": t(adv, torch.float64)}
