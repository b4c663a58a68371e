"""Allocation strategies: who gets how many rollouts (stage 1) and continuations (stage 2).

Every kind spends the same number of leaves (complete trajectories) per step, so methods
compare at equal sampling cost. With ``M = roots`` and ``N = continuations`` (the paper's
budget ``(M, N)``)::

    L = M (1 + N)                 leaves per step, for every kind

    uniform      (GRPO)           L/G prompts x G rollouts, no branching
    random_tree  (TreePO)         M/G prompts x G bare rollouts; m_i N continuations each,
                                  from prefixes drawn uniformly at random (with replacement)
    prompt       (PCL-like)       solve_roots with budget L on predictions, no branching
    prefix                        random_tree's roots; m_i N continuations per prompt by
                                  solve_prefixes on (r, p), as trace's stage 2
    trace        (TRACE)          solve_roots with budget M, then solve_prefixes with budget
                                  m_i N per prompt on (r, p) = (bare rollout's reward,
                                  prediction at the prefix)
    oracle                        trace on true success probabilities instead of predictions

(``G = group_size``.) Budget a prompt cannot use for continuations (all its rollouts were
single-turn, or its prefixes are capped) is pooled and spent on other prompts' prefixes; see
``PrefixPlanner``.

Exploration (``prompt``, ``trace``, ``oracle``): ``floor(explore_fraction * B / G)`` prompts
(B the root budget) get G rollouts each, drawn by the allocator's RNG among the prompts the
solver left out; the solver spends the rest. Trust (``prompt``, ``prefix``, ``trace`` with
``full_trust_skill``): a stage's predictions plan only the share ``w`` of its budget that
their measured skill earns (``allocation.trust``); the rest is planned as ``random_tree``
plans it, G rollouts for random prompts and continuations from random prefixes. Cold start
(``prompt``, ``prefix``, ``trace``):
while the predictor has trained on fewer than ``cold_start_nodes`` nodes, roots are planned
as by ``uniform`` (``prefix``, ``trace``: as by ``random_tree``, random prefixes included),
so an untrained predictor steers nothing. ``oracle`` never cold-starts: its inputs are not a
trained model. Resting prompts (``Node.resting``, set by ``PromptHistory``'s ``rest``) are
closed to the solved kinds' stage 1 while the other candidates can take its budget.

``prompt`` and ``prefix`` are trace's two stages one at a time: with ``random_tree`` (neither)
they tell which of trace's choices pays on a given world and budget.

How ``rollout.step.collect_step`` calls it, once per step::

    plan = allocator.plan_roots(len(candidates), predictions, predictor_nodes_seen)
    # sample plan.rollouts[i] bare rollouts for each candidate i with rollouts[i] > 0
    planner = allocator.prefix_planner(trees, cold_start=plan.cold_start)
    # after any turn: the trees whose bare rollouts all ended, scored and (trace) predicted
    for tree, node, k in planner.plan(done): ...  # sample k continuations from node
    # once every tree is planned: the pool of budget trees could not use
    for tree, node, k in planner.spend_pool(): ...
    # planner.unspent: budget no prefix could take, sampled as extra bare rollouts
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from trace_lightning.math.solvers import (
    draw_random,
    solve_prefixes,
    solve_roots,
    spend_pool,
    spendable_roots,
    unflatten,
)
from trace_lightning.allocation.trust import Stage, Trust
from trace_lightning.tree import Node, RolloutTree, bare_reward

Kind = Literal["uniform", "random_tree", "prompt", "prefix", "trace", "oracle"]
KINDS: tuple[str, ...] = get_args(Kind)
_BRANCHING = ("random_tree", "prefix", "trace", "oracle")  # spend continuations on prefixes
_SOLVED = ("prompt", "trace", "oracle")  # kinds whose roots come from solve_roots
_LEARNED = ("prompt", "prefix", "trace")  # kinds planned by the trained predictor (cold start)
_UNIFORM_ROOTS = ("uniform", "random_tree", "prefix")  # stage 1 is G rollouts per prompt


@dataclass
class RootPlan:
    """Stage 1: rollouts per candidate prompt, in the candidate list's order."""

    rollouts: list[int]  # m_i per candidate (0 = filtered out)
    random_picks: list[bool]  # True where the exploration share chose the prompt
    cold_start: bool = False  # planned as by uniform because the predictor is not trusted yet
    resting: int = 0  # candidates kept closed because they rest (``PromptHistory``'s rest)

    @property
    def leaves(self) -> int:
        return sum(self.rollouts)


class Allocator:
    """Plans each step's rollouts and continuations at equal leaves per step.

    Args:
        kind: ``uniform`` (GRPO), ``random_tree`` (TreePO random node), ``prompt`` (PCL-like
            root filtering), ``prefix`` (random_tree's roots, prefixes by predicted success),
            ``trace`` (roots + prefixes by predicted success) or ``oracle`` (trace on true
            success probabilities).
        roots: root budget ``M`` per step (the paper's M).
        continuations: continuations ``N`` per bare rollout (the paper's N); leaves per step
            are ``M (1 + N)`` for every kind.
        max_rollouts_per_prompt: most bare rollouts one prompt may get (``m_max``).
        group_size: rollouts per prompt for uniform schedules, exploration and cold start.
        prompts_per_step: most prompts opened per step (None: no limit).
        explore_fraction: share of the root budget given to random prompts (solved kinds).
        cold_start_nodes: predictor training nodes needed before ``prompt``/``prefix``/``trace``
            trust it.
        max_continuations_per_prefix: most continuations from one prefix (None: no limit).
        full_trust_skill: the measured Brier skill at which a stage's predictions plan all of
            its budget (``allocation.trust``); below it they plan the share
            ``skill / full_trust_skill`` and random_tree's rule the rest. None: predictions
            plan everything, whatever their skill (``prompt``, ``prefix``, ``trace`` only).
        skill_window: steps whose scored predictions measure the skill.
        seed: seed of the allocator's RNGs: one for exploration picks, drawn in
            ``plan_roots`` (identically on every rank: all plan the same global step), one
            for random prefixes, drawn once per step by ``PrefixPlanner`` to seed its
            per-prompt generators (per rank, over its own trees, so its draws differ between
            ranks and must not move the exploration stream); ``start_step`` reseeds the latter
            from (seed, step, rank).
    """

    def __init__(self, kind: Kind, roots: int, continuations: int, max_rollouts_per_prompt: int,
                 group_size: int, prompts_per_step: int | None = None,
                 explore_fraction: float = 0.0, cold_start_nodes: int = 0,
                 max_continuations_per_prefix: int | None = None,
                 full_trust_skill: float | None = None, skill_window: int = 4,
                 seed: int = 0) -> None:
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
        # the oracle's inputs are true probabilities, not a model's: nothing to earn
        self.trust = (Trust(full_trust_skill, skill_window)
                      if full_trust_skill is not None and kind in _LEARNED else None)
        self._rng = np.random.default_rng(seed)  # random prefixes (rank-local draws)
        self._explore_rng = np.random.default_rng([seed, 1])  # exploration (global draws)

        # the uniform schedule this kind may use: L/G (uniform, prompt) or M/G prompts of G
        can_be_uniform = kind in _UNIFORM_ROOTS or (kind in _LEARNED and cold_start_nodes > 0)
        if can_be_uniform:
            budget = self.root_budget
            if budget % group_size:
                what = f"{f}roots * (1 + {f}continuations)" if budget != roots else f"{f}roots"
                why = "" if kind in _UNIFORM_ROOTS else " (cold start plans uniformly)"
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
    def branches(self) -> bool:
        """Whether this kind spends continuations on prefixes (and so has a stage 2)."""
        return self.kind in _BRANCHING

    @property
    def predicts(self) -> bool:
        """Whether this kind plans from success predictions (once out of its cold start)."""
        return self.kind in _SOLVED + _LEARNED

    @property
    def solves_roots(self) -> bool:
        """Whether stage 1 reads predictions (every candidate's root is then predicted)."""
        return self.kind in _SOLVED

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
        if self.kind in _UNIFORM_ROOTS:
            return uniform
        solve = self.root_budget - self.n_explore * self.group_size
        solved = -(-solve // self.max_rollouts_per_prompt) + self.n_explore
        return max(solved, uniform) if self.cold_start_nodes > 0 else solved

    def is_cold(self, predictor_nodes_seen: int) -> bool:
        return self.kind in _LEARNED and predictor_nodes_seen < self.cold_start_nodes

    # ---- trust -----------------------------------------------------------------------------
    def weight(self, stage: Stage) -> float:
        """The share of ``stage``'s budget its predictions plan (1 without ``trust``)."""
        return 1.0 if self.trust is None else self.trust.weight(stage)

    def record_outcomes(self, trees: Sequence[RolloutTree], stage1: Sequence[int]) -> None:
        """Score the step's predictions against its outcomes (``Trust.record``); the next
        step's plan follows them as far as their skill goes. No-op without trust."""
        if self.trust is not None:
            self.trust.record(trees, stage1)

    # ---- stage 1 ---------------------------------------------------------------------------
    def plan_roots(self, n_candidates: int, predictions: Sequence[float] | None = None,
                   predictor_nodes_seen: int = 0,
                   prediction_counts: Sequence[float | None] | None = None,
                   resting: Sequence[bool] | None = None) -> RootPlan:
        """Rollouts per candidate prompt.

        Args:
            n_candidates: size of the step's candidate list (already shuffled by the caller;
                uniform schedules take its first prompts).
            predictions: predicted (``oracle``: true) success per candidate; needed by
                ``prompt``/``trace``/``oracle`` unless cold, ignored otherwise.
            predictor_nodes_seen: nodes the predictor has trained on (for the cold start).
            prediction_counts: rollouts each prediction is worth (``Node.prediction_count``;
                None entries, or None: exact), see ``solve_roots``.
            resting: per candidate, whether it rests (``Node.resting``). Solved kinds open
                only the others (the solver and exploration alike) unless those cannot take
                the budget; then every candidate may be opened. Ignored by uniform schedules.
        """
        cand = "--data.candidates_per_step"
        cold = self.is_cold(predictor_nodes_seen)
        if self.kind in _UNIFORM_ROOTS or cold:
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
        if n_candidates < n_explore:
            raise ValueError(f"{cand} ({n_candidates}) is below the {n_explore} exploration "
                             f"prompts of kind {self.kind!r} (explore_fraction "
                             f"{self.explore_fraction}); raise it")
        if resting is not None and len(resting) != n_candidates:
            raise ValueError(f"resting ({len(resting)} values) must give one flag per "
                             f"candidate ({n_candidates})")
        # the candidates stage 1 may open: those not resting, if they can take the budget
        eligible = list(range(n_candidates))
        fresh = [i for i in eligible if resting is None or not resting[i]]
        if len(fresh) < n_candidates and self._solver_cap(len(fresh), n_explore) is not None:
            eligible = fresh
        # the share of the solver's budget its predictions have not earned goes to random
        # prompts of G rollouts, as many whole groups as leave the solver a spendable budget
        shrink = math.floor((1.0 - self.weight("roots"))  # (+ 1e-9: a float's last bit)
                            * (self.root_budget - n_explore * self.group_size) / self.group_size
                            + 1e-9)
        while shrink > 0 and self._solver_cap(len(eligible), n_explore + shrink) is None:
            shrink -= 1
        n_explore += shrink
        solve = self.root_budget - n_explore * self.group_size
        k = self._solver_cap(len(eligible), n_explore)
        if k is None:
            raise ValueError(f"{cand} ({n_candidates}) is too small: {n_candidates} prompts of at "
                             f"most {self.max_rollouts_per_prompt} rollouts cannot take the "
                             f"{solve} rollouts kind {self.kind!r} must spend; raise it")
        chosen = solve_roots([predictions[i] for i in eligible], solve,
                             self.max_rollouts_per_prompt, k,
                             counts=None if prediction_counts is None
                             else [prediction_counts[i] for i in eligible])
        rollouts = [0] * n_candidates
        for i, m in zip(eligible, chosen):
            rollouts[i] = m
        unchosen = [i for i, m in zip(eligible, chosen) if m == 0]  # >= n_explore (the cap)
        picks = (self._explore_rng.choice(len(unchosen), size=n_explore, replace=False)
                 if n_explore else [])
        random_picks = [False] * n_candidates
        for j in sorted(int(x) for x in picks):
            rollouts[unchosen[j]] = self.group_size
            random_picks[unchosen[j]] = True
        return RootPlan(rollouts=rollouts, random_picks=random_picks, cold_start=False,
                        resting=n_candidates - len(eligible))

    def _solver_cap(self, n: int, n_explore: int) -> int | None:
        """Most prompts the root solver may open among ``n`` eligible candidates (the
        ``n_explore`` random prompts left outside its choice), or None when those cannot take
        the solver's budget."""
        solve = self.root_budget - n_explore * self.group_size
        k = n - n_explore
        if self.prompts_per_step is not None:
            k = min(k, self.prompts_per_step - n_explore)
        if k < 0 or spendable_roots(solve, n, self.max_rollouts_per_prompt, k) != solve:
            return None
        return k

    # ---- stage 2 ---------------------------------------------------------------------------
    def prefix_planner(self, trees: Sequence[RolloutTree],
                       cold_start: bool = False) -> PrefixPlanner:
        """One step's stage 2 over ``trees`` (in step order), tree by tree (kinds with
        branching)."""
        if self.kind not in _BRANCHING:
            raise ValueError(f"kind {self.kind!r} does not branch: it has no stage 2")
        return PrefixPlanner(self, cold_start, trees)

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
        state = {"rng": self._rng.bit_generator.state,
                 "explore_rng": self._explore_rng.bit_generator.state}
        if self.trust is not None:
            state["trust"] = self.trust.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]
        if "explore_rng" in state:  # a state without it: exploration keeps its seeded RNG
            self._explore_rng.bit_generator.state = state["explore_rng"]
        if self.trust is not None and "trust" in state:  # else: trust is earned again
            self.trust.load_state_dict(state["trust"])


class PrefixPlanner:
    """One step's stage 2, tree by tree: a prompt branches as soon as its bare rollouts end.

    ``plan(trees)`` is phase 1 for those trees: each spends its own ``m_i N`` continuations
    on its own prefixes (``solve_prefixes``, or random draws for ``random_tree`` and a cold
    start), so it needs nothing of the trees still running. What a tree cannot use goes to
    the pool. ``spend_pool()``, once every tree is planned, is phase 2 (``spend_pool``):
    the pool over every tree's prefixes, in the step's order of trees. The counts do not
    depend on the order trees finish in: they are those of planning every tree at once, in
    step order (phase 1 is per tree, and phase 2 starts from it), ties included, and
    each tree's random draws come from its own generator (seeded from the allocator's RNG,
    one draw per step, and the tree's position).

    The pool is over this planner's trees: under several processes each rank plans its own
    share of the prompts, so a rank whose prompts have no prefix left to take it spends it
    as extra bare rollouts (``collect_step``) even when another rank's prefixes could. The
    leaves per step stay the same; where the leftover goes depends on how the prompts fall on
    the ranks (a shared pool would make every rank wait for all ranks' bare rollouts).

    Args:
        allocator: the step's allocator (a kind with branching).
        cold_start: the root plan's ``cold_start`` (``prefix``/``trace`` then branch at random).
        trees: every tree of the step this planner will plan, in step order.
    """

    def __init__(self, allocator: Allocator, cold_start: bool,
                 trees: Sequence[RolloutTree]) -> None:
        self.allocator = allocator
        self.random = allocator.kind == "random_tree" or cold_start
        # the share of each budget the predictions plan (random_tree's rule plans the rest)
        self.weight = 1.0 if self.random else allocator.weight("prefixes")
        self.trees = list(trees)
        self._position = {id(t): i for i, t in enumerate(self.trees)}
        draws = self.random or self.weight < 1.0
        self._base = int(allocator._rng.integers(2**63 - 1)) if draws else 0
        n = len(self.trees)
        self._prefixes: list[list[Node] | None] = [None] * n  # per tree, at planning
        self._pairs: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # (r, p)
        self._counts: list[list[int]] = [[] for _ in range(n)]
        self.pool_returned = 0  # budget trees could not use themselves (alloc/pool_returned)
        self.unspent = 0  # of that, what no prefix could take (set by spend_pool)
        self.pool_spent = False

    @property
    def all_planned(self) -> bool:
        return all(p is not None for p in self._prefixes)

    def plan(self, trees: Sequence[RolloutTree]) -> list[tuple[RolloutTree, int, int]]:
        """Phase 1 for ``trees`` (bare rollouts finished and scored; ``prefix``, ``trace``
        and ``oracle``: every prefix predicted): ``(tree, node id, continuations)`` to
        sample, zeros left out."""
        alloc, cap = self.allocator, self.allocator.max_continuations_per_prefix
        out = []
        for t in trees:
            i = self._position.get(id(t))
            if i is None or self._prefixes[i] is not None:
                why = "not one of the planner's trees" if i is None else "already planned"
                raise ValueError(f"tree {t.tree_id} is {why}; each tree is planned once")
            nodes = t.prefixes()
            budget = len(t.bare_rollouts()) * alloc.continuations
            rng = np.random.default_rng([self._base, i])
            if self.random:
                counts = [0] * len(nodes)
                draw_random(counts, budget, rng, cap)
            else:
                self._pairs[i] = self._pairs_of(t, nodes)
                at_random = self._untrusted(budget, rng)
                counts = solve_prefixes([r for r, _ in self._pairs[i]],
                                        [p for _, p in self._pairs[i]], budget - at_random, cap)
                draw_random(counts, at_random, rng, cap)
            self.pool_returned += budget - sum(counts)
            self._prefixes[i], self._counts[i] = nodes, counts
            for node, c in zip(nodes, counts):
                node.continuations = c
                if c:
                    out.append((t, node.id, c))
        return out

    def spend_pool(self) -> list[tuple[RolloutTree, int, int]]:
        """Phase 2, once every tree is planned: the pool over every tree's prefixes; returns
        the continuations it adds. ``unspent`` is then what no prefix could take."""
        if self.pool_spent:
            raise ValueError("spend_pool runs once per step")
        if not self.all_planned:
            raise ValueError("every tree must be planned before spend_pool")
        self.pool_spent = True
        cap = self.allocator.max_continuations_per_prefix
        if self.random:
            flat = [c for cs in self._counts for c in cs]
            rng = np.random.default_rng([self._base, len(self.trees)])
            self.unspent = self.pool_returned - draw_random(flat, self.pool_returned, rng, cap)
            new = unflatten(flat, [len(cs) for cs in self._counts])
        else:
            flat = [c for cs in self._counts for c in cs]
            rng = np.random.default_rng([self._base, len(self.trees)])
            at_random = draw_random(flat, self._untrusted(self.pool_returned, rng), rng, cap)
            new, self.unspent = spend_pool(self._pairs,
                                           unflatten(flat, [len(cs) for cs in self._counts]),
                                           self.pool_returned - at_random, cap)
        out = []
        for t, nodes, old, counts in zip(self.trees, self._prefixes, self._counts, new):
            for node, c0, c in zip(nodes, old, counts):
                node.continuations = c
                if c > c0:
                    out.append((t, node.id, c - c0))
        self._counts = new
        return out

    def _untrusted(self, budget: int, rng: np.random.Generator) -> int:
        """How much of ``budget`` goes to random prefixes: ``(1 - weight) budget``, rounded
        up or down at random so that its expectation is exact."""
        if self.weight >= 1.0 or budget <= 0:
            return 0
        share = (1.0 - self.weight) * budget
        return math.floor(share) + int(rng.random() < share - math.floor(share))

    def _pairs_of(self, t: RolloutTree, nodes: list[Node]) -> list[tuple[float, float]]:
        """``(r, p)`` per prefix: its bare rollout's reward and its prediction."""
        rewards = {j: bare_reward(t, j) for j in {t.nodes[i].rollout for i in t.bare_rollouts()}}
        pairs = []
        for node in nodes:
            if node.prediction is None:
                raise ValueError(f"prefix node {node.id} of tree {t.tree_id} has no "
                                 f"prediction; run the predictor on every prefix before "
                                 f"planning its continuations (kind {self.allocator.kind!r})")
            pairs.append((rewards[node.rollout], float(node.prediction)))
        return pairs
