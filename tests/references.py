"""Plain references the tests check the library against (tests only).

- Advantages: ``grpo_loop``, ``tree_grpo_loop``, ``treepo_loop``, ``segment_loop``,
  ``branch_grpo_loop``, plain loops over the leaves for the vectorised kinds of
  ``trace_lightning.math.advantage``.
- Prefix allocation: ``spread_prefix_budget`` (both phases of stage 2 over all prompts at
  once, on ``(r, p)`` pairs) and ``plan_prefixes`` (both phases of an ``Allocator``'s
  ``PrefixPlanner`` over finished trees at once, as a ``PrefixPlan``): the one-shot counts
  the planner's tree-by-tree schedule must give.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trace_lightning.math.advantage import EPS, LeafKey, _check_trees, _spread
from trace_lightning.math.solvers import solve_prefixes, spend_pool
from trace_lightning.allocation.allocators import _BRANCHING, Allocator, PrefixPlanner, RootPlan
from trace_lightning.tree import RolloutTree

# ---- advantages ------------------------------------------------------------------------------


def _normalize_one(values: list[float], r: float, norm_by_std: bool, eps: float) -> float:
    """``r`` normalised within ``values`` (which contains ``r``)."""
    n = len(values)
    if n == 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return (r - mean) / (std + eps) if norm_by_std else r - mean


def _leaves_below(tree: RolloutTree, node_id: int) -> list[float]:
    out, stack = [], [node_id]
    while stack:
        n = tree.nodes[stack.pop()]
        if n.finished:
            out.append(float(n.reward))
        stack.extend(n.children)
    return out


def grpo_loop(trees: Sequence[RolloutTree], norm_by_std: bool = True,
              eps: float = EPS) -> dict[LeafKey, float]:
    """Reference for ``advantage.grpo`` (plain loops)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        group = [float(n.reward) for n in t.leaves()]
        for n in t.leaves():
            out[(t.tree_id, n.id)] = _normalize_one(group, float(n.reward), norm_by_std, eps)
    return out


def tree_grpo_loop(trees: Sequence[RolloutTree], norm_by_std: bool = True,
                   eps: float = EPS) -> dict[LeafKey, float]:
    """Reference for ``advantage.tree_grpo`` (plain loops)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        leaves = t.leaves()
        prompt = [float(n.reward) for n in leaves]
        for n in leaves:
            sub = [float(m.reward) for m in leaves if m.rollout == n.rollout]
            r = float(n.reward)
            out[(t.tree_id, n.id)] = _normalize_one(prompt, r, norm_by_std, eps) \
                + _normalize_one(sub, r, norm_by_std, eps)
    return out


def treepo_loop(trees: Sequence[RolloutTree], norm_by_std: bool = True,
                eps: float = EPS) -> dict[LeafKey, float]:
    """Reference for ``advantage.treepo`` (plain loops, leaves found by walking down)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        for leaf in t.leaves():
            r = float(leaf.reward)
            terms = []
            for anc in t.path(leaf.id)[:-1]:
                below = _leaves_below(t, anc.id)
                if anc.parent is None or len(below) >= 2:
                    terms.append(_normalize_one(below, r, norm_by_std, eps))
            out[(t.tree_id, leaf.id)] = sum(terms) / len(terms)
    return out


def segment_loop(trees: Sequence[RolloutTree]) -> dict[LeafKey, list[float]]:
    """Reference for ``advantage.segment`` (plain loops)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        for leaf in t.leaves():
            per_node = {n.id: float(leaf.reward) - t.nodes[n.parent].value
                        for n in t.path(leaf.id)[1:]}
            out[(t.tree_id, leaf.id)] = _spread(t, leaf.id, per_node)
    return out


def branch_grpo_loop(trees: Sequence[RolloutTree], norm_by_std: bool = True,
                     eps: float = EPS) -> dict[LeafKey, list[float]]:
    """Reference for ``advantage.branch_grpo``: each turn's group found by walking up from its
    parent to the first node with two or more leaves below (leaves found by walking down)."""
    _check_trees(trees)
    out = {}
    for t in trees:
        for leaf in t.leaves():
            per_node = {}
            for n in t.path(leaf.id)[1:]:
                b = t.nodes[n.parent]
                while b.parent is not None and len(_leaves_below(t, b.id)) < 2:
                    b = t.nodes[b.parent]
                per_node[n.id] = _normalize_one(_leaves_below(t, b.id), float(leaf.reward),
                                                norm_by_std, eps)
            out[(t.tree_id, leaf.id)] = _spread(t, leaf.id, per_node)
    return out


# ---- prefix allocation -----------------------------------------------------------------------


@dataclass
class PrefixSpread:
    """Continuations per prompt and prefix, and how the shared pool was used."""

    counts: list[list[int]]  # counts[i][k]: continuations from prompt i's k-th prefix
    pool_returned: int  # budget prompts could not use themselves
    unspent: int  # of that, what no prefix anywhere could take (0 unless every prefix is capped)


def spread_prefix_budget(per_prompt_prefixes: Sequence[Sequence[tuple[float, float]]],
                         per_prompt_budget: Sequence[int], cap: int | None = None) -> PrefixSpread:
    """Per prompt ``solve_prefixes``, then spend the returned budget across all prompts.

    Args:
        per_prompt_prefixes: per prompt, one ``(r, p)`` pair per non-leaf prefix.
        per_prompt_budget: per prompt, its continuation budget (``m_i N``).
        cap: most continuations per prefix (None: no limit).

    The one-shot form of what ``allocators.PrefixPlanner`` computes prompt by prompt. Phase 1
    is per prompt. Whatever a prompt cannot spend (no prefixes: all rollouts single-turn; or
    all capped) goes to a pool, which phase 2 (``spend_pool``) spends with the same greedy
    over every prompt's prefixes, starting from the phase-1 counts. Total spent is
    ``sum(per_prompt_budget) - unspent``, and ``unspent == 0`` whenever the prefixes can
    hold the budget (any prefix at all, without a cap).
    """
    if len(per_prompt_prefixes) != len(per_prompt_budget):
        raise ValueError(f"one budget per prompt expected (got {len(per_prompt_prefixes)} "
                         f"prompts and {len(per_prompt_budget)} budgets)")
    counts: list[list[int]] = []
    pool = 0
    for prefixes, budget in zip(per_prompt_prefixes, per_prompt_budget):
        c = solve_prefixes([x[0] for x in prefixes], [x[1] for x in prefixes], budget, cap)
        pool += budget - sum(c)
        counts.append(c)
    counts, unspent = spend_pool(per_prompt_prefixes, counts, pool, cap)
    return PrefixSpread(counts=counts, pool_returned=pool, unspent=unspent)


@dataclass
class PrefixPlan:
    """Stage 2: continuations per prefix, keyed ``(tree index, node id)``; zeros omitted."""

    continuations: dict[tuple[int, int], int] = field(default_factory=dict)
    pool_returned: int = 0  # budget prompts could not use themselves
    unspent: int = 0  # budget no prefix could take (every prefix capped, or none at all)

    @property
    def leaves(self) -> int:
        return sum(self.continuations.values())


def planned_leaves(roots: RootPlan, prefixes: PrefixPlan | None = None) -> int:
    """Leaves the step will produce: one per bare rollout plus one per continuation."""
    return roots.leaves + (prefixes.leaves if prefixes is not None else 0)


def prefix_plan(planner: PrefixPlanner) -> PrefixPlan:
    """A planner's counts so far as a ``PrefixPlan`` keyed ``(index in step order, node id)``."""
    plan = PrefixPlan(pool_returned=planner.pool_returned, unspent=planner.unspent)
    for ti, (nodes, counts) in enumerate(zip(planner._prefixes, planner._counts)):
        for node, c in zip(nodes or [], counts):
            if c:
                plan.continuations[(ti, node.id)] = c
    return plan


def plan_prefixes(allocator: Allocator, trees: Sequence[RolloutTree],
                  cold_start: bool = False) -> PrefixPlan:
    """Continuations per non-leaf prefix of every tree at once; sets ``node.continuations``.

    ``allocator.prefix_planner``'s ``plan(trees)`` then ``spend_pool()`` in one call. Call
    after the bare rollouts are finished and scored and (``trace``, ``oracle``) every
    prefix's ``node.prediction`` is set, before any continuation is added. Kinds without
    branching return an empty plan.

    Args:
        allocator: the step's allocator.
        trees: the opened prompts' trees (keys of the result index this list).
        cold_start: the root plan's ``cold_start`` (``trace`` then branches at random).
    """
    if allocator.kind not in _BRANCHING:
        return PrefixPlan()
    planner = allocator.prefix_planner(trees, cold_start)
    planner.plan(trees)
    planner.spend_pool()
    return prefix_plan(planner)
