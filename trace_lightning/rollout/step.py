"""One RL iteration's data: budgeted rollout trees, from candidate prompts to training sequences.

    candidates ─> predictor ─> root plan ─> bare rollouts ─> predictor on prefixes
               ─> prefix plan ─> continuations ─> rewards, values ─> advantages ─> sequences
                  └──────── per prompt, as soon as its bare rollouts end ────────┘

Every step spends the same number of leaves whatever the allocator (equal sampling cost);
what each phase spent (leaves, generated tokens, tool calls) and took (seconds) is kept on
the ``RolloutStep`` for the monitoring callbacks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from trace_lightning.math.advantage import assign_advantages
from trace_lightning.allocation.allocators import Allocator, RootPlan
from trace_lightning.tasks.base import Example
from trace_lightning.rollout.agent import AgentLoop, Start
from trace_lightning.tree import Budget, LeafSequence, RolloutTree

# Sets ``node.prediction`` on the given trees: on every root, and on every non-leaf turn node.
Predict = Callable[[list[RolloutTree]], None]


@dataclass
class RolloutStep:
    """What one epoch's sampling produced and cost."""

    epoch: int
    trees: list[RolloutTree]  # trees that got budget (candidates filtered out are not here)
    candidates: int  # prompts the allocator chose from
    root_plan: list[int]  # rollouts per candidate (0 = filtered out)
    sequences: list[LeafSequence]
    budget: Budget
    pool_returned: int = 0  # continuations a prompt could not use, spent elsewhere
    unspent: int = 0  # continuations no prefix could take, spent as extra bare rollouts
    # wall seconds of rollout, tools and predict
    seconds: dict[str, float] = field(default_factory=dict)
    cold_start: bool = False
    # per tree of ``trees``, its stage-1 (planned) bare rollouts: indices 0..m-1; budget no
    # prefix could take adds bare rollouts after them (``unspent``). Empty: all are stage 1.
    stage1: list[int] = field(default_factory=list)
    # turns the step ran, each one batched engine call (the oracle's probes, which are its
    # predictions, not counted): the length of its longest chain of turns, which per-prompt
    # stage 2 keeps short
    engine_calls: int = 0
    # the share of each stage's budget the predictions planned ("roots", "prefixes"; from
    # the allocator's measured trust); empty where trust is not measured
    trust: dict[str, float] = field(default_factory=dict)


@dataclass
class StepSpec:
    """What one step is to do, besides its loop, allocator and candidates.

    Args:
        epoch: the RL step (the trainer's epoch).
        seed: seed of the step's sampling (the two-wave schedule's second wave: seed + 1).
        advantage: the tree advantage (``math.advantage``).
        predict: the shared predictor for ``prompt``, ``prefix`` and ``trace``, or an
            estimate from extra rollouts for ``oracle`` (``oracle_predict``); allocators that
            need no predictions never call it (``prefix`` only on the opened prompts).
        predictor_nodes_seen: nodes the predictor has learnt from (the cold start).
        shard: ``(rank, world_size)``: every rank plans the same global budget and rolls out
            the chosen prompts ``rank::world_size``.
        agree: makes the ranks' root plans one (the data module passes rank 0's to all):
            each rank computes its own predictions, and a last-bit difference between them
            (GPU kernels) could flip a solver's choice, so a prompt would be rolled out twice
            and another not at all.
        any_rank: (several processes) ORs flags over the ranks, so that every rank predicts
            on the same turns and a turn that fails on one rank stops them all
            (``agent.Growth``).
        overlap: stage 2 per prompt as soon as its bare rollouts end; False waits for every
            bare rollout first (two waves: the same plan;
            ``benchmarks/rollout_schedule.py`` compares the two schedules).
    """

    epoch: int
    seed: int
    advantage: str = "tree_grpo"
    predict: Predict | None = None
    predictor_nodes_seen: int = 0
    shard: tuple[int, int] = (0, 1)
    agree: Callable[[RootPlan], RootPlan] | None = None
    any_rank: Callable[[list[bool]], list[bool]] | None = None
    overlap: bool = True


def collect_step(loop: AgentLoop, allocator: Allocator, candidates: Sequence[Example],
                 spec: StepSpec) -> RolloutStep:
    """Build one step's trees with ``allocator`` and turn them into training sequences.

    Stage 1 plans each candidate's bare rollouts. Stage 2 (branching kinds) runs per prompt:
    the step grows the trajectories turn by turn (``AgentLoop.grow``), and after each turn
    the prompts whose bare rollouts have all ended get their prefixes predicted and their
    continuations planned (``PrefixPlanner``), which join the next turn beside the other
    prompts' stage 1. Once every prompt is planned, the pool of budget prompts could not use
    is spent, and what no prefix can take becomes extra bare rollouts, round robin, so every
    allocator spends the same leaves.
    """
    predict, nodes_seen = spec.predict, spec.predictor_nodes_seen
    seconds: dict[str, float] = {}
    tic, calls = time.perf_counter(), loop.engine_calls
    trees = [loop.new_tree(e) for e in candidates]
    cold = allocator.is_cold(nodes_seen)
    trust = ({stage: allocator.weight(stage) for stage in ("roots", "prefixes")}
             if allocator.trust is not None and not cold else {})
    informed = allocator.predicts and not cold
    if informed and predict is None:
        raise ValueError(f"allocator kind {allocator.kind!r} needs predictions; pass "
                         f"the predictor (or oracle_predict for 'oracle')")
    by_prediction = informed and allocator.solves_roots  # stage 1 reads every candidate's root
    if by_prediction:
        predict(trees)
    seconds["predict"] = time.perf_counter() - tic

    plan = allocator.plan_roots(len(trees), [t.root.prediction for t in trees]
                                if by_prediction else None, nodes_seen,
                                [t.root.prediction_count for t in trees]
                                if by_prediction else None,
                                [t.root.resting for t in trees] if by_prediction else None)
    if spec.agree is not None:
        plan = spec.agree(plan)
    rank, world = spec.shard
    opened = [(t, m) for t, m in zip(trees, plan.rollouts) if m > 0][rank::world]
    chosen = [t for t, _ in opened]
    planner = allocator.prefix_planner(chosen, plan.cold_start) if allocator.branches else None

    def branch(done: list[RolloutTree]) -> list[Start]:
        """Stage 2 of the trees in ``done``; the pool once every tree is planned."""
        assert planner is not None
        tic = time.perf_counter()
        if informed:  # on every rank on the same turns, ``done`` empty or not
            predict(done)
        seconds["predict"] += time.perf_counter() - tic
        starts = [Start(t, node, k) for t, node, k in planner.plan(done)]
        if planner.all_planned and not planner.pool_spent:
            starts += [Start(t, node, k) for t, node, k in planner.spend_pool()]
            extra = [0] * len(chosen)
            for i in range(planner.unspent if chosen else 0):
                extra[i % len(chosen)] += 1
            starts += [Start(t, 0, k) for t, k in zip(chosen, extra) if k]
        return starts

    tic, predicted, tooled = time.perf_counter(), seconds["predict"], loop.tool_s
    first = [Start(t, 0, m) for t, m in opened]
    seed, any_rank = spec.seed, spec.any_rank
    try:
        if planner is None:
            budget = loop.expand(first, seed=seed, any_rank=any_rank)
        elif spec.overlap:
            growth = loop.grow(first, seed=seed, any_rank=any_rank)
            for done in growth:  # after a turn that ended some prompts' bare rollouts
                with growth.guard():
                    growth.add(branch(done))
            budget = growth.budget
        else:
            budget = loop.expand(first, seed=seed, any_rank=any_rank)
            budget.add(loop.expand(branch(chosen), seed=seed + 1, any_rank=any_rank))
    finally:
        loop.release()  # the prefixes' saved tool states: no continuation starts after this
    # the predictions made between turns are counted as "predict", and the task's tool calls
    # (searches, queries) as "tools": "rollout" is the rest (the engine's sampling, parsing,
    # bookkeeping)
    seconds["tools"] = loop.tool_s - tooled
    seconds["rollout"] = (time.perf_counter() - tic - (seconds["predict"] - predicted)
                          - seconds["tools"])

    for t in chosen:
        t.compute_values()
    if informed:  # the predictions that steered this step, scored: how far the next trusts them
        allocator.record_outcomes(chosen, [m for _, m in opened])
    sequences = [s for t in chosen for s in t.flatten()]
    for seq, adv in zip(sequences, assign_advantages(sequences, chosen, spec.advantage)):
        seq.token_advantages = adv
    return RolloutStep(epoch=spec.epoch, trees=chosen, candidates=len(candidates),
                       root_plan=list(plan.rollouts), sequences=sequences, budget=budget,
                       pool_returned=planner.pool_returned if planner else 0,
                       unspent=planner.unspent if planner else 0, seconds=seconds,
                       cold_start=plan.cold_start, stage1=[m for _, m in opened],
                       engine_calls=loop.engine_calls - calls, trust=trust)


OracleNodes = Literal["all", "roots", "prefixes"]


def oracle_predict(loop: AgentLoop, samples: int, seed: int, nodes: OracleNodes = "all",
                   learned: Predict | None = None) -> Predict:
    """Success odds estimated by ``samples`` extra rollouts from each node (not counted in any
    budget): the predictions of a perfect predictor, for the ``oracle`` allocator.

    ``nodes`` says which nodes the probes estimate: ``all``, or one stage's (``roots``: the
    candidates stage 1 plans from; ``prefixes``: the turns stage 2 branches from). The other
    stage's predictions are ``learned``'s (the shared predictor, run first on every node), so
    that each stage's share of the oracle's gain can be measured apart."""
    if nodes not in get_args(OracleNodes):
        raise ValueError(f"oracle nodes {nodes!r} must be 'all', 'roots' or 'prefixes'")
    if (nodes == "all") != (learned is None):
        raise ValueError(f"oracle nodes {nodes!r}: the nodes the probes leave out need the "
                         f"learned predictions, and 'all' leaves none out")
    if loop.env.continuation != "none":
        raise ValueError(f"the oracle's probes roll out from a prefix's tokens alone, without "
                         f"the tool state it left, and {type(loop.env).__name__}'s tools keep "
                         f"state (continuation {loop.env.continuation!r}): use another "
                         f"--data.allocator.kind for this task")
    # the probes grow in a loop of their own: they are no leaves of the step, and their
    # turns and tool calls count as the step's "predict" time
    probing = AgentLoop(loop.engine, loop.env, loop.sampling, continues=False)
    calls = itertools.count()
    estimates: dict[tuple[int, int], float] = {}  # by (id(tree), node id): each probed once

    def predict(trees: list[RolloutTree]) -> None:
        if learned is not None:
            learned(trees)  # every node; the probed stage's are set again below
        probes, targets = [], []
        for t in trees:
            own = ([t.root] if nodes != "prefixes" else []) + (
                t.prefixes() if nodes != "roots" else [])
            for n in own:
                if (id(t), n.id) in estimates:  # stage 2 calls again on stage 1's trees
                    n.prediction = estimates[(id(t), n.id)]
                    continue
                probe = RolloutTree.new(t.tree_id, t.question, t.answers, t.prefix_ids(n.id))
                probe.root.depth = n.depth  # the turn limit counts from the real depth
                probes.append(probe)
                targets.append((t, n))
        # a seed per call: stage 2 calls once per turn, and probe i of two calls must not
        # draw the same samples
        call_seed = int(np.random.SeedSequence([seed, next(calls)]).generate_state(1)[0])
        probing.expand([Start(p, 0, samples) for p in probes], seed=call_seed)
        for p, (t, n) in zip(probes, targets):
            rewards = [leaf.reward for leaf in p.leaves()]
            n.prediction = estimates[(id(t), n.id)] = sum(rewards) / len(rewards)

    return predict
