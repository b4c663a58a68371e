"""Tree-aware, group-relative advantages: pure functions over rollout trees.

Every function takes the step's trees (leaves carry ``reward``; ``compute_values()`` done) and
works on per-leaf scalars; :func:`token_advantages` / :func:`assign_advantages` turn them into
the common per-token form (one ``list[float]`` per leaf, aligned with
``LeafSequence.input_ids``, zero off policy tokens) so the loss takes one ``(B, T)`` tensor.

Group normalisation (used by every kind but ``segment``), for a group ``G`` of leaves::

    norm_G(r) = (r - mean_G) / (std_G + eps)      norm_by_std=True (GRPO)
    norm_G(r) =  r - mean_G                        norm_by_std=False (Dr. GRPO: centre only)

- ``std`` is the unbiased sample std (ddof=1), as ``torch.std`` in verl's GRPO
  (``compute_grpo_outcome_advantage``); ``eps = 1e-6``. For a group of two with rewards
  ``{1, 0}`` this gives ``+-0.7071`` (population std would give ``+-1``).
- **Group of one: mean 0, std 1** (our design notes, and verl's convention for a prompt with one
  response): a lone leaf's normalised value is ``r / (1 + eps)`` (``r`` without std), i.e. the
  reward itself, not 0. A group whose rewards are all equal (size >= 2) gives 0.

Kinds (``AdvantageKind``):

- ``grpo``: ``A = norm_prompt(r)``, the group being all leaves of the tree (prompt).
- ``tree_grpo`` (default; Tree-GRPO): ``A = norm_prompt(r) + norm_subtree(r)``, the second
  group being the leaves of the same bare-rollout subtree (``Node.rollout``). With the
  group-of-one rule a bare rollout that was never branched (one leaf) gets ``r`` as its
  subtree term: e.g. an all-success tree gives its unbranched leaves ``A = 0 + 1``.
- ``treepo`` (TreePO-style ancestor averaging): the groups of a leaf are the root plus every
  inner node on its path with ``n_leaves >= 2`` (the leaf itself is never a group); each group
  is the set of leaves below that node. ``A = mean over those groups of norm_G(r)``. The root
  is always a group, so a one-leaf tree falls back to the group-of-one rule (``A = r``), the
  same as ``grpo`` on that tree.
- ``branch_grpo`` (per turn, the nearest branch point's group): the policy tokens of turn ``n``
  get ``norm_G(r)``, ``G`` the leaves below the deepest node at or above ``parent(n)`` with
  ``n_leaves >= 2`` (its nearest branch point; the root if there is none). Above a branch
  point a turn gets the prompt group's GRPO advantage; below it, its own branch's contrast:
  two endings of one prefix with rewards ``{1, 0}`` get ``+-0.7071`` and equal endings 0, so
  a turn's baseline is the value of the state it was sampled from wherever the tree sampled
  that state more than once. A turn whose parent has one leaf below falls back to the next
  branch point up, so every turn gets an advantage (unlike ``segment``), and a tree that never
  branched gets exactly ``grpo``'s.
- ``segment`` (per-segment ``R - V(anchor)``): varies along the sequence. The policy tokens of
  turn ``n`` get ``R_leaf - value(parent(n))``: the anchor is the prefix the turn was generated
  from, and ``value`` is the bottom-up tree value (mean leaf reward below). No std
  normalisation (``norm_by_std``/``eps`` are ignored). A turn whose anchor has a single leaf
  below gets 0 (its baseline equals its return: no contrast was sampled there).

Deviations from the papers: Tree-GRPO and TreePO define their groups over their own tree
shapes (fixed branching per depth); here groups follow whatever shape TRACE's allocation
produced, with the group-of-one rule above. Advantages are outcome-only: no per-token
discount, no KL-in-reward.

Each scalar kind is vectorised (numpy ``bincount`` over group ids); the tests check every
kind, the per-token ones included, against plain-loop references (``tests/references.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

from trace_lightning.tree import LeafSequence, RolloutTree

LeafKey = tuple[str, int]  # (tree_id, leaf_id)
AdvantageKind = Literal["tree_grpo", "grpo", "treepo", "segment", "branch_grpo"]
PER_TOKEN_KINDS: tuple[str, ...] = ("segment", "branch_grpo")  # vary along the sequence
ADVANTAGE_KINDS: tuple[str, ...] = get_args(AdvantageKind)
EPS = 1e-6


# ---- checks ---------------------------------------------------------------------------------
def _check_trees(trees: Sequence[RolloutTree]) -> None:
    seen: set[str] = set()
    for t in trees:
        if t.tree_id in seen:
            raise ValueError(f"tree_id {t.tree_id!r} appears twice in one batch; advantages are "
                             f"keyed by (tree_id, leaf_id), so give every tree a unique id")
        seen.add(t.tree_id)
        leaves = t.leaves()
        for n in leaves:
            if n.reward is None:
                raise ValueError(f"leaf {n.id} of tree {t.tree_id!r} has no reward; score every "
                                 f"leaf before computing advantages")
        if leaves and t.root.n_leaves != len(leaves):
            raise ValueError(f"tree {t.tree_id!r} has stale or missing values (root.n_leaves="
                             f"{t.root.n_leaves}, {len(leaves)} leaves); call "
                             f"tree.compute_values() after the last leaf is added and scored")


def _check_kind(kind: str) -> None:
    if kind not in ADVANTAGE_KINDS:
        raise ValueError(f"advantage kind {kind!r} is unknown; expected one of {ADVANTAGE_KINDS}")


# ---- group normalisation --------------------------------------------------------------------
def normalize_groups(rewards: np.ndarray, groups: np.ndarray, norm_by_std: bool = True,
                     eps: float = EPS) -> np.ndarray:
    """Normalise each reward within its group (vectorised).

    Args:
        rewards: ``(N,)`` rewards.
        groups: ``(N,)`` integer group ids in ``0..G-1``.
        norm_by_std: divide by ``std + eps`` (GRPO); ``False`` only subtracts the mean.
        eps: added to the std.

    Returns:
        ``(N,)`` normalised rewards; groups of one use mean 0, std 1; std is unbiased (ddof=1).
    """
    rewards = np.asarray(rewards, dtype=np.float64)  # (N,)
    groups = np.asarray(groups, dtype=np.int64)  # (N,)
    if rewards.size == 0:
        return rewards
    n_groups = int(groups.max()) + 1
    count = np.bincount(groups, minlength=n_groups).astype(np.float64)  # (G,)
    total = np.bincount(groups, weights=rewards, minlength=n_groups)  # (G,)
    mean = total / np.maximum(count, 1.0)  # (G,)
    dev = rewards - mean[groups]  # (N,)
    var = np.bincount(groups, weights=dev * dev, minlength=n_groups) / np.maximum(count - 1, 1)
    std = np.sqrt(var)  # (G,)
    lone = count == 1  # (G,)
    mean[lone] = 0.0
    std[lone] = 1.0
    out = rewards - mean[groups]  # (N,)
    if norm_by_std:
        out = out / (std[groups] + eps)  # (N,)
    return out


# ---- vectorised scalar kinds ----------------------------------------------------------------
def _leaf_table(trees: Sequence[RolloutTree]):
    keys: list[LeafKey] = []
    tree_idx: list[int] = []
    rollout: list[int] = []
    rewards: list[float] = []
    for i, t in enumerate(trees):
        for n in t.leaves():
            keys.append((t.tree_id, n.id))
            tree_idx.append(i)
            rollout.append(n.rollout)
            rewards.append(float(n.reward))
    return keys, np.array(tree_idx, dtype=np.int64), np.array(rollout, dtype=np.int64), \
        np.array(rewards, dtype=np.float64)


def grpo(trees: Sequence[RolloutTree], norm_by_std: bool = True,
         eps: float = EPS) -> dict[LeafKey, float]:
    """GRPO: each leaf's reward normalised over all leaves of its tree."""
    _check_trees(trees)
    keys, tree_idx, _, rewards = _leaf_table(trees)
    adv = normalize_groups(rewards, tree_idx, norm_by_std, eps)  # (N,)
    return dict(zip(keys, adv.tolist()))


def tree_grpo(trees: Sequence[RolloutTree], norm_by_std: bool = True,
              eps: float = EPS) -> dict[LeafKey, float]:
    """Tree-GRPO: ``norm_prompt(r) + norm_subtree(r)`` (subtree = same bare rollout)."""
    _check_trees(trees)
    keys, tree_idx, rollout, rewards = _leaf_table(trees)
    if not keys:
        return {}
    _, sub_groups = np.unique(np.stack([tree_idx, rollout], axis=1), axis=0,
                              return_inverse=True)  # (N,)
    adv = normalize_groups(rewards, tree_idx, norm_by_std, eps) \
        + normalize_groups(rewards, sub_groups.reshape(-1), norm_by_std, eps)  # (N,)
    return dict(zip(keys, adv.tolist()))


def treepo(trees: Sequence[RolloutTree], norm_by_std: bool = True,
           eps: float = EPS) -> dict[LeafKey, float]:
    """TreePO-style: mean of ``norm_G(r)`` over the root and inner ancestors with >= 2 leaves."""
    _check_trees(trees)
    keys, _, _, rewards = _leaf_table(trees)
    # One (leaf, group) pair per group a leaf belongs to; group = (tree, ancestor node).
    pair_leaf: list[int] = []
    pair_group: list[int] = []
    group_id: dict[tuple[int, int], int] = {}
    k = 0
    for ti, t in enumerate(trees):
        for leaf in t.leaves():
            for anc in t.path(leaf.id)[:-1]:
                if anc.parent is None or anc.n_leaves >= 2:
                    pair_leaf.append(k)
                    pair_group.append(group_id.setdefault((ti, anc.id), len(group_id)))
            k += 1
    if not keys:
        return {}
    pair_leaf_a = np.array(pair_leaf, dtype=np.int64)  # (P,)
    normed = normalize_groups(rewards[pair_leaf_a], np.array(pair_group), norm_by_std, eps)  # (P,)
    adv = np.bincount(pair_leaf_a, weights=normed, minlength=len(keys)) \
        / np.bincount(pair_leaf_a, minlength=len(keys))  # (N,)
    return dict(zip(keys, adv.tolist()))


# ---- per-token form -------------------------------------------------------------------------
def _spread(tree: RolloutTree, leaf_id: int, per_node: dict[int, float]) -> list[float]:
    """Per-token list along the root->leaf path: ``per_node[node]`` on that node's policy tokens."""
    out: list[float] = []
    for n in tree.path(leaf_id):
        a = per_node.get(n.id, 0.0)
        out.extend(a if m else 0.0 for m in n.policy_mask)
    return out


def segment(trees: Sequence[RolloutTree]) -> dict[LeafKey, list[float]]:
    """Per-segment ``R - V(anchor)``: per-token advantages along each leaf's sequence."""
    _check_trees(trees)
    out = {}
    for t in trees:
        value = np.array([np.nan if n.value is None else n.value for n in t.nodes])  # (n_nodes,)
        for leaf in t.leaves():
            path = t.path(leaf.id)
            anchor = np.array([n.parent for n in path[1:]], dtype=np.int64)  # (D,)
            seg = float(leaf.reward) - value[anchor]  # (D,)
            lengths = np.array([len(n.token_ids) for n in path])  # (D+1,)
            per_token = np.repeat(np.concatenate([[0.0], seg]), lengths)  # (T,)
            mask = np.fromiter((m for n in path for m in n.policy_mask), dtype=np.float64,
                               count=int(lengths.sum()))  # (T,)
            out[(t.tree_id, leaf.id)] = (per_token * mask).tolist()
    return out


def branch_grpo(trees: Sequence[RolloutTree], norm_by_std: bool = True,
                eps: float = EPS) -> dict[LeafKey, list[float]]:
    """Per turn, ``norm_G(r)`` over the leaves below its nearest branch point (module doc)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        leaves = t.leaves()
        if not leaves:
            continue
        r = np.array([float(n.reward) for n in leaves])  # (L,)
        # Each node's group is the leaves below it: their count and mean are the tree's
        # values; the std needs their squared deviations, which each leaf adds along its path.
        count = np.array([n.n_leaves for n in t.nodes], dtype=np.float64)  # (n_nodes,)
        mean = np.array([0.0 if n.value is None else n.value for n in t.nodes])  # (n_nodes,)
        on_path = [[n.id for n in t.path(leaf.id)] for leaf in leaves]
        idx = np.concatenate([np.asarray(p, dtype=np.int64) for p in on_path])  # (P,)
        per = np.repeat(r, [len(p) for p in on_path])  # (P,)
        var = np.bincount(idx, weights=(per - mean[idx]) ** 2, minlength=len(t.nodes)) \
            / np.maximum(count - 1.0, 1.0)  # (n_nodes,)
        std = np.sqrt(var)  # (n_nodes,)
        mean[count == 1], std[count == 1] = 0.0, 1.0  # a group of one (only a one-leaf root)
        for leaf, path, reward in zip(leaves, on_path, r):
            group, b = [], path[0]  # each turn's nearest branch point at or above its parent
            for parent in path[:-1]:
                b = parent if count[parent] >= 2 else b
                group.append(b)
            a = reward - mean[group]  # (D,) one per turn
            if norm_by_std:
                a = a / (std[group] + eps)
            out[(t.tree_id, leaf.id)] = _spread(t, leaf.id, dict(zip(path[1:], a.tolist())))
    return out


def _per_token(trees: Sequence[RolloutTree], kind: str, norm_by_std: bool,
               eps: float) -> dict[LeafKey, list[float]]:
    """The per-token kinds (``PER_TOKEN_KINDS``)."""
    if kind == "segment":
        return segment(trees)
    return branch_grpo(trees, norm_by_std, eps)


def leaf_advantages(trees: Sequence[RolloutTree], kind: AdvantageKind = "tree_grpo",
                    norm_by_std: bool = True, eps: float = EPS) -> dict[LeafKey, float]:
    """Scalar advantage per leaf for ``grpo`` / ``tree_grpo`` / ``treepo`` (not the
    per-token ``segment`` / ``branch_grpo``)."""
    _check_kind(kind)
    if kind == "grpo":
        return grpo(trees, norm_by_std, eps)
    elif kind == "tree_grpo":
        return tree_grpo(trees, norm_by_std, eps)
    elif kind == "treepo":
        return treepo(trees, norm_by_std, eps)
    else:
        raise ValueError(f"advantage kind {kind!r} has no scalar per leaf (it varies along the "
                         f"sequence); use token_advantages, or one of grpo, tree_grpo, treepo")


def token_advantages(trees: Sequence[RolloutTree], kind: AdvantageKind = "tree_grpo",
                     norm_by_std: bool = True, eps: float = EPS) -> dict[LeafKey, list[float]]:
    """Per-token advantages of every leaf, aligned with its flattened ``input_ids``.

    Args:
        trees: the step's trees (rewards on leaves, ``compute_values()`` done).
        kind: ``tree_grpo`` (default), ``grpo``, ``treepo``, ``segment`` or ``branch_grpo``.
        norm_by_std: divide by the group std (ignored by ``segment``).
        eps: added to the std (ignored by ``segment``).

    Returns:
        ``{(tree_id, leaf_id): list[float]}``; each list has one entry per token of the
        root->leaf path (as ``RolloutTree.flatten``), 0.0 on prompt and observation tokens.
    """
    _check_kind(kind)
    if kind in PER_TOKEN_KINDS:
        return _per_token(trees, kind, norm_by_std, eps)
    return _spread_scalars(trees, leaf_advantages(trees, kind, norm_by_std, eps))


def _spread_scalars(trees: Sequence[RolloutTree],
                    scalar: dict[LeafKey, float]) -> dict[LeafKey, list[float]]:
    """Each leaf's scalar advantage on every policy token of its path (``_spread``)."""
    out = {}
    for t in trees:
        for leaf in t.leaves():
            a = scalar[(t.tree_id, leaf.id)]
            out[(t.tree_id, leaf.id)] = _spread(t, leaf.id, {n.id: a for n in t.path(leaf.id)})
    return out


def assign_advantages(seqs: Sequence[LeafSequence], trees: Sequence[RolloutTree],
                      kind: AdvantageKind = "tree_grpo", norm_by_std: bool = True,
                      eps: float = EPS) -> list[list[float]]:
    """Compute advantages and attach them to ``seqs``.

    Sets ``seq.advantage`` (a scalar: the leaf's advantage; for the per-token kinds, the mean
    over its policy tokens, a summary for logging) and returns the per-token lists, aligned with
    ``seqs`` and with each ``seq.input_ids``, for :func:`trace_lightning.packing.leaves.collate`.
    """
    _check_kind(kind)
    if kind in PER_TOKEN_KINDS:
        per_token, scalar = _per_token(trees, kind, norm_by_std, eps), None
    else:  # the scalars once, spread as token_advantages does
        scalar = leaf_advantages(trees, kind, norm_by_std, eps)
        per_token = _spread_scalars(trees, scalar)
    out = []
    for s in seqs:
        key = (s.tree_id, s.leaf_id)
        if key not in per_token:
            raise ValueError(f"sequence {key} has no leaf among the given trees; pass the trees "
                             f"the sequences were flattened from")
        adv = per_token[key]
        assert len(adv) == len(s.input_ids), (key, len(adv), len(s.input_ids))
        if scalar is not None:
            s.advantage = scalar[key]
        else:
            n_policy = sum(s.policy_mask)
            s.advantage = sum(adv) / n_policy if n_policy else 0.0
        out.append(adv)
    return out
