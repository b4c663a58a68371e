"""Allocation strategies: who gets how many rollouts (stage 1) and continuations (stage 2).

Every kind spends the same number of leaves (complete trajectories) per step, so methods
compare at equal sampling cost. With ``M = roots`` and ``N = continuations`` (the paper's
budget ``(M, N)``)::

    L = M (1 + N)                 leaves per step, for every kind

    uniform      (GRPO)           L/G prompts x G rollouts, no branching
    random_tree  (TreePO)         M/G prompts x G bare rollouts; m_i N continuations each,
                                  from prefixes drawn uniformly at random (with replacement)
    prompt       (PCL-like)       solve_roots with budget L on predictions, no branching
    trace        (TRACE)          solve_roots with budget M, then solve_prefixes with budget
                                  m_i N per prompt on (r, p) = (bare rollout's reward,
                                  prediction at the prefix)
    oracle                        trace on true success probabilities instead of predictions

(``G = group_size``.) Budget a prompt cannot use for continuations (all its rollouts were
single-turn, or its prefixes are capped) is pooled and spent on other prompts' prefixes; see
``allocation.spread_prefix_budget``.

Exploration (``prompt``, ``trace``, ``oracle``): ``floor(explore_fraction * B / G)`` prompts
(B the root budget) get G rollouts each, drawn by the allocator's RNG among the prompts the
solver left out; the solver spends the rest. Cold start (``prompt``, ``trace``): while the
predictor has trained on fewer than ``cold_start_nodes`` nodes, roots are planned as by
``uniform`` (``trace``: as by ``random_tree``, random prefixes included), so an untrained
predictor steers nothing. ``oracle`` never cold-starts: its inputs are not a trained model.

How the DataModule calls it, once per step::

    plan = allocator.plan_roots(len(candidates), predictions, predictor_nodes_seen)
    # sample plan.rollouts[i] bare rollouts for each candidate i with rollouts[i] > 0
    # (trees in candidate order, opened ones only), score them, predict every prefix
    prefixes = allocator.plan_prefixes(trees, cold_start=plan.cold_start)
    # node.continuations is now set on every chosen prefix; sample those continuations
    assert planned_leaves(plan, prefixes) == allocator.leaves_per_step  (unless unspent > 0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from trace_lightning.allocation import (
    PrefixSpread,
    solve_roots,
    spendable_roots,
    spread_prefix_budget,
    spread_random,
)
from trace_lightning.tree import RolloutTree

Kind = Literal["uniform", "random_tree", "prompt", "trace", "oracle"]
KINDS: tuple[str, ...] = get_args(Kind)
_BRANCHING = ("random_tree", "trace", "oracle")  # kinds that spend continuations on prefixes
_SOLVED = ("prompt", "trace", "oracle")  # kinds whose roots come from solve_roots


@dataclass
class RootPlan:
    """Stage 1: rollouts per candidate prompt, in the candidate list's order."""

    rollouts: list[int]  # m_i per candidate (0 = filtered out)
    random_picks: list[bool]  # True where the exploration share chose the prompt
    cold_start: bool = False  # planned as by uniform because the predictor is not trusted yet

    @property
    def chosen(self) -> list[int]:
        """Indices of the opened candidates, in candidate order (the order of the trees)."""
        return [i for i, m in enumerate(self.rollouts) if m > 0]

    @property
    def leaves(self) -> int:
        return sum(self.rollouts)


@dataclass
class PrefixPlan:
    """Stage 2: continuations per prefix, keyed ``(tree index, node id)``; zeros omitted."""

    continuations: dict[tuple[int, int], int] = field(default_factory=dict)
    pool_returned: int = 0  # budget prompts could not use themselves (alloc/pool_returned)
    unspent: int = 0  # budget no prefix could take (every prefix capped, or none at all)

    @property
    def leaves(self) -> int:
        return sum(self.continuations.values())


def planned_leaves(roots: RootPlan, prefixes: PrefixPlan | None = None) -> int:
    """Leaves the step will produce: one per bare rollout plus one per continuation."""
    return roots.leaves + (prefixes.leaves if prefixes is not None else 0)


def bare_reward(tree: RolloutTree, rollout: int) -> float:
    """The terminal reward of bare rollout ``rollout``'s own chain.

    The chain starts at the root's child with that rollout index and follows each node's
    first child (the bare rollout's own next turn; continuations are added later) to its
    leaf.
    """
    starts = [i for i in tree.root.children if tree.nodes[i].rollout == rollout]
    if len(starts) != 1:
        raise ValueError(f"tree {tree.tree_id} has {len(starts)} bare rollouts with index "
                         f"{rollout}; expected exactly one")
    node = tree.nodes[starts[0]]
    while not node.finished:
        if not node.children:
            raise ValueError(f"bare rollout {rollout} of tree {tree.tree_id} stops at unfinished "
                             f"node {node.id}; finish the bare rollouts before plan_prefixes")
        node = tree.nodes[node.children[0]]
    if node.reward is None:
        raise ValueError(f"leaf {node.id} of tree {tree.tree_id} has no reward; score the bare "
                         f"rollouts before plan_prefixes")
    return float(node.reward)


class Allocator:
    """Plans each step's rollouts and continuations at equal leaves per step.

    Args:
        kind: ``uniform`` (GRPO), ``random_tree`` (TreePO random node), ``prompt`` (PCL-like
            root filtering), ``trace`` (roots + prefixes by predicted success) or ``oracle``
            (trace on true success probabilities).
        roots: root budget ``M`` per step (the paper's M).
        continuations: continuations ``N`` per bare rollout (the paper's N); leaves per step
            are ``M (1 + N)`` for every kind.
        max_rollouts_per_prompt: most bare rollouts one prompt may get (``m_max``).
        group_size: rollouts per prompt for uniform schedules, exploration and cold start.
        prompts_per_step: most prompts opened per step (None: no limit).
        explore_fraction: share of the root budget given to random prompts (solved kinds).
        cold_start_nodes: predictor training nodes needed before ``prompt``/``trace`` trust it.
        max_continuations_per_prefix: most continuations from one prefix (None: no limit).
        seed: seed of the allocator's RNGs: one for exploration picks, drawn in
            ``plan_roots`` (identically on every rank: all plan the same global step), one
            for random prefixes, drawn in ``plan_prefixes`` (per rank, over its own trees, so
            its draws differ between ranks and must not move the exploration stream);
            ``start_step`` reseeds the latter from (seed, step, rank).
    """

    def __init__(self, kind: Kind, roots: int, continuations: int, max_rollouts_per_prompt: int,
                 group_size: int, prompts_per_step: int | None = None,
                 explore_fraction: float = 0.0, cold_start_nodes: int = 0,
                 max_continuations_per_prefix: int | None = None, seed: int = 0) -> None:
        f = "--data.allocator."
        if kind not in KINDS:
            raise ValueError(f"{f}kind ({kind!r}) is unknown; expected one of {', '.join(KINDS)}")
        if roots < 2:
            raise ValueError(f"{f}roots ({roots}) must be >= 2: a prompt needs two rollouts "
                             f"for any contrast")
        if continuations < 0:
            raise ValueError(f"{f}continuations ({continuations}) must be >= 0")
        if continuations == 0 and kind in _BRANCHING:
            raise ValueError(f"{f}continuations (0) must be >= 1 when kind is {kind!r}; set it "
                             f"or use kind 'prompt' (or 'uniform') for no branching")
        if group_size < 2:
            raise ValueError(f"{f}group_size ({group_size}) must be >= 2: a group of one has no "
                             f"contrast")
        if max_rollouts_per_prompt < 2:
            raise ValueError(f"{f}max_rollouts_per_prompt ({max_rollouts_per_prompt}) must be "
                             f">= 2: an opened prompt gets at least 2 rollouts")
        if group_size > max_rollouts_per_prompt:
            raise ValueError(f"{f}group_size ({group_size}) exceeds {f}max_rollouts_per_prompt "
                             f"({max_rollouts_per_prompt}); raise the maximum or lower the group")
        if not 0.0 <= explore_fraction < 1.0:
            raise ValueError(f"{f}explore_fraction ({explore_fraction}) must be in [0, 1)")
        if cold_start_nodes < 0:
            raise ValueError(f"{f}cold_start_nodes ({cold_start_nodes}) must be >= 0")
        if max_continuations_per_prefix is not None and max_continuations_per_prefix < 1:
            raise ValueError(f"{f}max_continuations_per_prefix ({max_continuations_per_prefix}) "
                             f"must be >= 1 or null (no cap)")
        if prompts_per_step is not None and prompts_per_step < 1:
            raise ValueError(f"{f}prompts_per_step ({prompts_per_step}) must be >= 1 or null")
        self.kind = kind
        self.roots = roots
        self.continuations = continuations
        self.max_rollouts_per_prompt = max_rollouts_per_prompt
        self.group_size = group_size
        self.prompts_per_step = prompts_per_step
        self.explore_fraction = explore_fraction
        self.cold_start_nodes = cold_start_nodes
        self.max_continuations_per_prefix = max_continuations_per_prefix
        self.seed = seed
        self._rng = np.random.default_rng(seed)  # random prefixes (rank-local draws)
        self._explore_rng = np.random.default_rng([seed, 1])  # exploration (global draws)

        # the uniform schedule this kind may use: L/G (uniform, prompt) or M/G prompts of G
        can_be_uniform = kind in ("uniform", "random_tree") or (
            kind in ("prompt", "trace") and cold_start_nodes > 0)
        if can_be_uniform:
            budget = self.root_budget
            if budget % group_size:
                what = f"{f}roots * (1 + {f}continuations)" if budget != roots else f"{f}roots"
                why = "" if kind in ("uniform", "random_tree") else " (cold start plans uniformly)"
                raise ValueError(f"{what} ({budget}) must be a multiple of {f}group_size "
                                 f"({group_size}) when kind is {kind!r}{why}: every prompt gets "
                                 f"group_size rollouts; change {f}roots or {f}group_size")
            if prompts_per_step is not None and prompts_per_step < budget // group_size:
                raise ValueError(f"{f}prompts_per_step ({prompts_per_step}) is below the "
                                 f"{budget // group_size} prompts of {group_size} rollouts that "
                                 f"kind {kind!r} opens; raise it or set it to null")
        if kind in _SOLVED:
            n_explore = self.n_explore
            if prompts_per_step is not None and n_explore >= prompts_per_step:
                raise ValueError(f"{f}explore_fraction ({explore_fraction}) opens {n_explore} "
                                 f"random prompts, leaving none of {f}prompts_per_step "
                                 f"({prompts_per_step}) to the solver; lower it")
            solve = self.root_budget - n_explore * group_size
            k = None if prompts_per_step is None else prompts_per_step - n_explore
            if spendable_roots(solve, solve, max_rollouts_per_prompt, k) != solve:
                raise ValueError(
                    f"the solver's root budget ({solve} = {self.root_budget} minus {n_explore} "
                    f"exploration prompts x {group_size}) cannot be spent exactly with "
                    f"{f}max_rollouts_per_prompt ({max_rollouts_per_prompt}) and "
                    f"{f}prompts_per_step ({prompts_per_step}); raise either, or change "
                    f"{f}roots / {f}explore_fraction")

    # ---- budgets ---------------------------------------------------------------------------
    @property
    def leaves_per_step(self) -> int:
        """``L = M (1 + N)``: leaves every kind spends per step."""
        return self.roots * (1 + self.continuations)

    @property
    def root_budget(self) -> int:
        """Bare rollouts per step: ``L`` for kinds without branching, ``M`` otherwise."""
        return self.roots if self.kind in _BRANCHING else self.leaves_per_step

    @property
    def n_explore(self) -> int:
        """Prompts given to exploration: ``floor(explore_fraction * root_budget / G)``."""
        if self.kind not in _SOLVED:
            return 0
        return math.floor(self.explore_fraction * self.root_budget / self.group_size)

    @property
    def prompts_needed(self) -> int:
        """Fewest candidates a step can be planned from: ``M/G`` for a uniform schedule (and
        a cold start), or the prompts that spend the solver's budget at ``m_max`` each plus
        the exploration prompts, whichever is more."""
        uniform = self.root_budget // self.group_size
        if self.kind in ("uniform", "random_tree"):
            return uniform
        solve = self.root_budget - self.n_explore * self.group_size
        solved = -(-solve // self.max_rollouts_per_prompt) + self.n_explore
        return max(solved, uniform) if self.cold_start_nodes > 0 else solved

    def is_cold(self, predictor_nodes_seen: int) -> bool:
        return self.kind in ("prompt", "trace") and predictor_nodes_seen < self.cold_start_nodes

    # ---- stage 1 ---------------------------------------------------------------------------
    def plan_roots(self, n_candidates: int, predictions: Sequence[float] | None = None,
                   predictor_nodes_seen: int = 0,
                   prediction_counts: Sequence[float | None] | None = None) -> RootPlan:
        """Rollouts per candidate prompt.

        Args:
            n_candidates: size of the step's candidate list (already shuffled by the caller;
                uniform schedules take its first prompts).
            predictions: predicted (``oracle``: true) success per candidate; needed by
                ``prompt``/``trace``/``oracle`` unless cold, ignored otherwise.
            predictor_nodes_seen: nodes the predictor has trained on (for the cold start).
            prediction_counts: rollouts each prediction is worth (``Node.prediction_count``;
                None entries, or None: exact), see ``solve_roots``.
        """
        cand = "--data.candidates_per_step"
        cold = self.is_cold(predictor_nodes_seen)
        if self.kind in ("uniform", "random_tree") or cold:
            k = self.root_budget // self.group_size
            if n_candidates < k:
                raise ValueError(f"{cand} ({n_candidates}) is below the {k} prompts of "
                                 f"{self.group_size} rollouts that kind {self.kind!r}"
                                 f"{' (cold start)' if cold else ''} needs; raise it")
            rollouts = [self.group_size] * k + [0] * (n_candidates - k)
            return RootPlan(rollouts=rollouts, random_picks=[False] * n_candidates,
                            cold_start=cold)

        if predictions is None or len(predictions) != n_candidates:
            got = "None" if predictions is None else f"{len(predictions)} values"
            raise ValueError(f"kind {self.kind!r} needs one prediction per candidate "
                             f"({n_candidates}), got {got}")
        n_explore = self.n_explore
        solve = self.root_budget - n_explore * self.group_size
        k = None if self.prompts_per_step is None else self.prompts_per_step - n_explore
        # leave the exploration prompts outside the solver's choice
        k = min(n_candidates - n_explore, n_candidates if k is None else k)
        rollouts = solve_roots(predictions, solve, self.max_rollouts_per_prompt, k,
                               counts=prediction_counts)
        if sum(rollouts) != solve:
            raise ValueError(f"{cand} ({n_candidates}) is too small: {n_candidates} prompts of at "
                             f"most {self.max_rollouts_per_prompt} rollouts cannot take the "
                             f"{solve} rollouts kind {self.kind!r} must spend; raise it")
        unchosen = [i for i, m in enumerate(rollouts) if m == 0]  # >= n_explore (the cap)
        picks = (self._explore_rng.choice(len(unchosen), size=n_explore, replace=False)
                 if n_explore else [])
        random_picks = [False] * n_candidates
        for j in sorted(int(x) for x in picks):
            rollouts[unchosen[j]] = self.group_size
            random_picks[unchosen[j]] = True
        return RootPlan(rollouts=rollouts, random_picks=random_picks, cold_start=False)

    # ---- stage 2 ---------------------------------------------------------------------------
    def plan_prefixes(self, trees: Sequence[RolloutTree], cold_start: bool = False) -> PrefixPlan:
        """Continuations per non-leaf prefix; sets ``node.continuations`` on every prefix.

        Call once per step, after the bare rollouts are finished and scored and (``trace``,
        ``oracle``) every prefix's ``node.prediction`` is set, before any continuation is
        added. Each tree's budget is ``N`` times its number of bare rollouts. Kinds without
        branching return an empty plan.

        The pool of budget a tree cannot use is over ``trees``: under several processes each
        rank plans its own share of the prompts, so a rank whose prompts have no prefix left
        to take it spends it as extra bare rollouts (``collect_step``) even when another
        rank's prefixes could. The leaves per step stay the same; where the leftover goes
        depends on how the prompts fall on the ranks (a shared pool would make every rank
        wait for all ranks' bare rollouts).

        Args:
            trees: the opened prompts' trees (keys of the result index this list).
            cold_start: the root plan's ``cold_start`` (``trace`` then branches at random).
        """
        if self.kind not in _BRANCHING:
            return PrefixPlan()
        prefixes = [t.prefixes() for t in trees]
        budgets = [len(t.bare_rollouts()) * self.continuations for t in trees]
        cap = self.max_continuations_per_prefix
        if self.kind == "random_tree" or cold_start:
            sizes = [len(p) for p in prefixes]
            spread: PrefixSpread = spread_random(sizes, budgets, self._rng, cap)
        else:
            pairs = []
            for t, nodes in zip(trees, prefixes):
                rollouts = {t.nodes[i].rollout for i in t.bare_rollouts()}
                rewards = {j: bare_reward(t, j) for j in rollouts}
                row = []
                for node in nodes:
                    if node.prediction is None:
                        raise ValueError(f"prefix node {node.id} of tree {t.tree_id} has no "
                                         f"prediction; run the predictor on every prefix before "
                                         f"plan_prefixes (kind {self.kind!r})")
                    row.append((rewards[node.rollout], float(node.prediction)))
                pairs.append(row)
            spread = spread_prefix_budget(pairs, budgets, cap)
        plan = PrefixPlan(pool_returned=spread.pool_returned, unspent=spread.unspent)
        for ti, (nodes, counts) in enumerate(zip(prefixes, spread.counts)):
            for node, c in zip(nodes, counts):
                node.continuations = c
                if c:
                    plan.continuations[(ti, node.id)] = c
        return plan

    # ---- resume ----------------------------------------------------------------------------
    def start_step(self, step: int, rank: int = 0) -> None:
        """Reseed the random-prefix draws from ``(seed, step, rank)``.

        Each rank draws over its own trees, so their streams differ, and a checkpoint holds
        rank 0's state only: seeded per step, every rank of a resumed run draws what it would
        have drawn had the run not stopped.
        """
        self._rng = np.random.default_rng([self.seed, 2, step, rank])

    def state_dict(self) -> dict[str, Any]:
        """The RNG states (plain dicts and ints), for an exact resume."""
        return {"rng": self._rng.bit_generator.state,
                "explore_rng": self._explore_rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]
        if "explore_rng" in state:  # checkpoints before it kept one RNG: exploration restarts
            self._explore_rng.bit_generator.state = state["explore_rng"]
