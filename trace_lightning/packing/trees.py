"""Tree packing: every token of a tree forwarded once, for the update and the features.

The leaves of a rollout tree share their prefixes' tokens. Forwarding each root-to-leaf path
on its own (``RolloutTree.flatten``) pays for a shared prefix once per leaf below it; laid out
as one sequence, a tree pays for each token once. The layout (a :class:`TreeUnit`):

- **Order**: the nodes depth-first (children in the order they were added), each node's
  tokens once. Depth-first makes every subtree one contiguous span.
- **Positions**: ``position_ids[i]`` is token i's position along its own root-to-leaf path
  (the tokens of its ancestors before it), so rotary embeddings see what they see per leaf.
- **Attention**: token ``i`` sees token ``j`` iff ``j <= i < subtree_end[j]``, where
  ``subtree_end[j]`` is the end of the span of the subtree of ``j``'s node. After ``j`` and
  inside that span lie exactly the tokens below ``j`` (its own node's later tokens and its
  node's descendants); a sibling subtree ends before the next one starts, so no token sees a
  sibling's. Then every token's hidden state equals the one it gets in its per-leaf sequence
  (how the attention runs it: :mod:`trace_lightning.packing.attention`).
- **Prediction rows**: ``prev[i]`` is the token before ``i`` on its path (``i - 1`` inside a
  node; the parent's last token for a node's first token): its hidden state predicts token
  ``i``. Several children read the same parent row.

A **unit** is a tree restricted to some of its *ends* (leaves for the update; any node without
children for the predictor's features): the union of their root paths. A tree larger than a
micro-batch splits at subtree boundaries into several units (:func:`split_ends`); the shared
prefix of those units is recomputed once per unit, and nothing is dropped.

**The update's objective is the per-leaf one.** For a fixed context, the clipped surrogate of a
(leaf, token) pair is ``A * f(r)`` with ``f`` depending only on the sign of ``A`` (see
:mod:`trace_lightning.math.loss`), so the terms of every leaf through a shared token add up to
``A+ f+(r) + A- f-(r)``: a token carries its leaves' summed positive and negative advantages
and their counts (:func:`leaf_weights`), and a unit's weights count its own leaves only, so a
split tree's units add up to the tree. Several units can share a packed row
(:func:`pack_rows`); no token sees another unit's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from trace_lightning.packing.leaves import split_balanced
from trace_lightning.packing.pairs import collate_pairs, leaf_pairs
from trace_lightning.tree import LeafSequence, RolloutTree
from trace_lightning.packing.attention import node_plan

WEIGHT_KEYS = ("count", "adv_pos", "adv_neg", "n_pos", "n_neg")


@dataclass
class TreeUnit:
    """One tree (or one part of a tree) laid out as one sequence; arrays are ``(L,)``."""

    tree_id: str
    input_ids: np.ndarray  # int64
    position_ids: np.ndarray  # int64: position along the token's own root-to-leaf path
    subtree_end: np.ndarray  # int64, exclusive: token i sees j iff j <= i < subtree_end[j]
    prev: np.ndarray  # int64: the token whose hidden state predicts this one (0 for token 0)
    policy_mask: np.ndarray  # float32: 1 on policy tokens
    old_logprobs: np.ndarray  # float32: behaviour log-probs, 0 off policy tokens
    last: dict[int, int]  # node id -> index of the last token of its prefix (its feature)
    spans: dict[int, tuple[int, int]]  # node id -> [start, stop) of its own tokens, in order
    parent: dict[int, int | None]  # node id -> its parent's
    # the update's per-token weights over the unit's leaves (see leaf_weights); None for
    # feature units
    weights: dict[str, np.ndarray] | None = field(default=None)
    # its (leaf, token) pairs: (leaf, index, advantage), (P,) each, for per-leaf weights
    # (``packing.pairs.leaf_pairs``); None for feature units
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.input_ids)


def _kept(tree: RolloutTree, ends: Sequence[int]) -> set[int]:
    """Ids of the nodes on the root paths of ``ends``."""
    keep: set[int] = set()
    for e in ends:
        i: int | None = e
        while i is not None and i not in keep:
            keep.add(i)
            i = tree.nodes[i].parent
    return keep


def layout(tree: RolloutTree, ends: Sequence[int]) -> TreeUnit:
    """The unit of ``tree`` made of the root paths of ``ends``, depth-first."""
    keep = _kept(tree, ends)
    ids, pos, ends_, prev, mask, logp = [], [], [], [], [], []
    spans: dict[int, tuple[int, int]] = {}
    last: dict[int, int] = {}
    path_len: dict[int, int] = {}
    node_end_slots: dict[int, list[int]] = {}  # node -> its tokens' slots in ends_
    cursor = 0
    stack: list[tuple[int, bool]] = [(0, False)]
    while stack:
        nid, done = stack.pop()
        if done:  # every token of the subtree is laid out: its span ends here
            for slot in node_end_slots.pop(nid):
                ends_[slot] = cursor
            continue
        n = tree.nodes[nid]
        k = len(n.token_ids)
        before = path_len[n.parent] if n.parent is not None else 0
        path_len[nid] = before + k
        ids += n.token_ids
        pos += range(before, before + k)
        mask += n.policy_mask
        logp += [x if m else 0.0 for x, m in zip(n.logprobs, n.policy_mask)]
        start = cursor
        prev += ([last[n.parent]] if n.parent is not None else [0])[:k]
        prev += range(start, start + k - 1)
        node_end_slots[nid] = list(range(len(ends_), len(ends_) + k))
        ends_ += [0] * k
        cursor += k
        spans[nid] = (start, cursor)
        last[nid] = cursor - 1 if k else (last[n.parent] if n.parent is not None else -1)
        stack.append((nid, True))
        stack += [(c, False) for c in reversed(n.children) if c in keep]
    if not ids:
        raise ValueError(f"tree {tree.tree_id} has no tokens to lay out")
    i64 = np.int64
    return TreeUnit(tree_id=tree.tree_id, input_ids=np.asarray(ids, dtype=i64),
                    position_ids=np.asarray(pos, dtype=i64),
                    subtree_end=np.asarray(ends_, dtype=i64), prev=np.asarray(prev, dtype=i64),
                    policy_mask=np.asarray(mask, dtype=np.float32),
                    old_logprobs=np.asarray(logp, dtype=np.float32), last=last, spans=spans,
                    parent={i: tree.nodes[i].parent for i in spans})


def split_ends(tree: RolloutTree, ends: Sequence[int], max_tokens: int) -> list[list[int]]:
    """``ends`` grouped into units of at most ``max_tokens`` tokens each, split at subtree
    boundaries: a subtree that fits (with its ancestors' tokens) stays whole; one that does
    not gives each child subtree (or a run of small ones) a unit of its own, recursively. A
    single path longer than ``max_tokens`` is a unit of its own, over budget (its tokens
    earned the reward; nothing is dropped). Groups keep depth-first order."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
    keep = _kept(tree, ends)
    wanted = set(ends)
    size: dict[int, int] = {}  # tokens in the kept subtree
    below: dict[int, list[int]] = {}  # ends in the kept subtree, depth-first
    for n in reversed(tree.nodes):  # children come after their parents
        if n.id not in keep:
            continue
        kids = [c for c in n.children if c in keep]
        size[n.id] = len(n.token_ids) + sum(size[c] for c in kids)
        below[n.id] = ([n.id] if n.id in wanted else []) + [e for c in kids for e in below[c]]
    parts: list[list[int]] = []

    def visit(nid: int, context: int) -> None:
        n = tree.nodes[nid]
        kids = [c for c in n.children if c in keep]
        if context + size[nid] <= max_tokens or not kids:
            parts.append(below[nid])
            return
        inner = context + len(n.token_ids)
        group: list[int] = [nid] if nid in wanted else []
        used = 0
        for c in kids:
            if inner + size[c] > max_tokens:  # too large for any part: split it too
                if group:
                    parts.append(group)
                    group, used = [], 0
                visit(c, inner)
                continue
            if group and inner + used + size[c] > max_tokens:
                parts.append(group)
                group, used = [], 0
            group += below[c]
            used += size[c]
        if group:
            parts.append(group)

    visit(0, 0)
    return parts


def leaf_weights(unit: TreeUnit, tree: RolloutTree,
                 leaves: Sequence[LeafSequence]) -> dict[str, np.ndarray]:
    """The update's per-token weights of ``unit`` over ``leaves`` (each ``(L,)``):
    ``count`` (leaves whose path holds the policy token), ``adv_pos`` / ``adv_neg`` (the sums
    of their positive / negative advantages on it) and ``n_pos`` / ``n_neg`` (how many).

    Each leaf's advantages are its ``token_advantages`` (aligned with its flattened path),
    so every advantage kind, per-token ``segment`` included, carries over unchanged."""
    n = len(unit)
    w = {k: np.zeros(n, dtype=np.float64) for k in WEIGHT_KEYS}
    for s in leaves:
        if s.token_advantages is None:
            raise ValueError(f"leaf ({s.tree_id}, {s.leaf_id}) has no token_advantages; "
                             f"assign advantages before packing")
        path = tree.path(s.leaf_id)
        idx = np.concatenate([np.arange(*unit.spans[p.id]) for p in path])  # (P,)
        m = np.asarray(s.policy_mask, dtype=np.float64)  # (P,)
        # rounded as a per-leaf row rounds them (float32), then summed exactly in float64
        a = np.asarray(s.token_advantages, dtype=np.float32).astype(np.float64) * m  # (P,)
        if len(idx) != len(a):
            raise ValueError(f"leaf ({s.tree_id}, {s.leaf_id}) has {len(a)} tokens but its "
                             f"path in the tree {len(idx)}; pack the trees it was flattened from")
        # a leaf's path visits each index once: plain fancy-index adds are exact
        w["count"][idx] += m
        w["adv_pos"][idx] += np.maximum(a, 0.0)
        w["adv_neg"][idx] += np.minimum(a, 0.0)
        w["n_pos"][idx] += (a > 0)
        w["n_neg"][idx] += (a < 0)
    return w


def update_units(tree: RolloutTree, leaves: Sequence[LeafSequence],
                 max_tokens: int) -> list[TreeUnit]:
    """``tree``'s units for the update, each at most ``max_tokens`` tokens where a split at
    subtree boundaries allows, with the weights of its own ``leaves``."""
    by_id = {s.leaf_id: s for s in leaves}
    units = []
    for ends in split_ends(tree, [s.leaf_id for s in leaves], max_tokens):
        unit = layout(tree, ends)
        unit.weights = leaf_weights(unit, tree, [by_id[e] for e in ends])
        unit.pairs = leaf_pairs(unit, tree, [by_id[e] for e in ends])
        units.append(unit)
    return units


def tree_minibatches(units: Sequence[Sequence[TreeUnit]], n_minibatches: int,
                     max_tokens: int, pad_id: int, seed: int) -> list[dict]:
    """One pass over a step's trees: ``n_minibatches`` mini-batches of whole trees (balanced
    by tokens forwarded), each a list of packed micro-batches (``micro``) and its (leaf,
    policy token) pairs (``n_tokens``, the token-mean's divisor, as per leaf).

    Each micro-batch also lists its (leaf, token) pairs (``rollout_correction.collate_pairs``:
    ``pair_row``, ``pair_pos``, ``pair_leaf``, ``pair_adv``), for per-leaf correction weights.

    Args:
        units: each tree's update units (``update_units``).
    """
    out = []
    sizes = [sum(len(u) for u in us) for us in units]
    for idx in split_balanced(sizes, n_minibatches, seed=seed):
        mini = [u for i in idx for u in units[i]]
        micro = []
        for rows in pack_rows([len(u) for u in mini], max_tokens):
            m = collate_units([[mini[j] for j in row] for row in rows], pad_id)
            if all(mini[j].pairs is not None for row in rows for j in row):
                m |= collate_pairs([mini[j] for row in rows for j in row], m["offsets"])
            micro.append(m)
        pairs = sum(float(u.weights["count"].sum()) for u in mini)
        out.append({"micro": micro, "n_tokens": pairs})
    return out


def unique_tokens(tree: RolloutTree) -> int:
    """Tokens of the tree's leaf paths, each counted once (what a packed update forwards)."""
    keep = _kept(tree, [n.id for n in tree.leaves()])
    return sum(len(tree.nodes[i].token_ids) for i in keep)


def pack_rows(lengths: Sequence[int], max_tokens: int) -> list[list[list[int]]]:
    """Unit indices grouped into micro-batches of rows: ``rows x width <= max_tokens``, the
    width being the micro-batch's longest unit.

    Longest first; a unit goes into the first row of the open micro-batch with room for it
    (several small units share a row, no attention between them), else a new row if one
    fits the budget, else it opens the next micro-batch. A unit longer than ``max_tokens``
    is a micro-batch of its own. Every index appears exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= 1; set the micro-batch token "
                         f"budget to at least the longest tree part you expect")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[list[int]]] = []
    used: list[int] = []  # tokens in each row of the open micro-batch
    width = 0
    for i in order:
        n = lengths[i]
        if batches:
            row = next((r for r, u in enumerate(used) if u + n <= width), None)
            if row is not None:
                batches[-1][row].append(i)
                used[row] += n
                continue
            if (len(used) + 1) * width <= max_tokens:
                batches[-1].append([i])
                used.append(n)
                continue
        batches.append([[i]])
        used, width = [n], n
    return batches


def collate_units(rows: Sequence[Sequence[TreeUnit]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of units into right-padded ``(R, T)`` tensors.

    Returns ``input_ids``, ``position_ids``, ``subtree_end``, ``prev`` (long),
    ``policy_mask``, ``old_logprobs`` (float32), the weights of :data:`WEIGHT_KEYS` (float64;
    0 where a unit has none), ``offsets`` ``(U, 2)``: each unit's row and first index, and
    where each node's prefix ends (the token whose final hidden state is its predictor
    feature): ``node_keys``, one ``(tree_id, node_id)`` per node of every unit, and
    ``node_ends`` ``(N, 2)``, its row and index, in the same order (a node in several units
    of a split tree is listed once per unit). A padding token sees itself alone
    (``subtree_end = i + 1``), so no attention row is empty.
    """
    if not rows or not all(rows):
        raise ValueError("collate_units needs at least one unit in every row")
    r, t = len(rows), max(sum(len(u) for u in row) for row in rows)
    ar = torch.arange(t)
    out = {"input_ids": torch.full((r, t), pad_id, dtype=torch.long),  # (R, T)
           "position_ids": torch.zeros((r, t), dtype=torch.long),  # (R, T)
           "subtree_end": (ar + 1).repeat(r, 1),  # (R, T)
           "prev": ar.clamp(min=1).sub(1).repeat(r, 1),  # (R, T)
           "policy_mask": torch.zeros((r, t)), "old_logprobs": torch.zeros((r, t))}
    # float64: sums of several leaves' float32 advantages, kept exact
    out |= {k: torch.zeros((r, t), dtype=torch.float64) for k in WEIGHT_KEYS}  # (R, T) each
    offsets: list[tuple[int, int]] = []
    keys: list[tuple[str, int]] = []
    ends: list[tuple[int, int]] = []
    nodes: list[list[tuple[int, int, list[int]]]] = []  # per row: node_plan's input
    for b, row in enumerate(rows):
        o = 0
        nodes.append([])
        for u in row:
            s = slice(o, o + len(u))
            out["input_ids"][b, s] = torch.from_numpy(u.input_ids)
            out["position_ids"][b, s] = torch.from_numpy(u.position_ids)
            out["subtree_end"][b, s] = torch.from_numpy(u.subtree_end) + o
            out["prev"][b, s] = torch.from_numpy(u.prev) + o
            out["policy_mask"][b, s] = torch.from_numpy(u.policy_mask)
            out["old_logprobs"][b, s] = torch.from_numpy(u.old_logprobs)
            for k, v in (u.weights or {}).items():
                out[k][b, s] = torch.from_numpy(v)
            offsets.append((b, o))
            keys += [(u.tree_id, nid) for nid in u.last]
            ends += [(b, o + pos) for pos in u.last.values()]
            nodes[b] += node_paths(u, o)
            o += len(u)
    out["offsets"] = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)  # (U, 2)
    out["node_keys"] = keys
    out["node_ends"] = torch.tensor(ends, dtype=torch.long).reshape(-1, 2)  # (N, 2)
    out["tree_nodes"] = node_plan(nodes, t)
    return out


def node_paths(unit: TreeUnit, offset: int) -> list[tuple[int, int, list[int]]]:
    """``(start, stop, path)`` of every node of ``unit`` in layout order, shifted by
    ``offset``: its own tokens and the indices of its root path's (``node_plan``)."""
    paths: dict[int, list[int]] = {}
    out = []
    for nid, (start, stop) in unit.spans.items():  # parents come first
        parent = unit.parent[nid]
        own = list(range(offset + start, offset + stop))
        paths[nid] = (paths[parent] if parent is not None else []) + own
        out.append((offset + start, offset + stop, paths[nid]))
    return out
