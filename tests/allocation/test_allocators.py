"""Allocation strategies: equal leaves per step, cold start, exploration, resume, pooling."""

from __future__ import annotations

import pytest

from references import PrefixPlan, plan_prefixes, planned_leaves, prefix_plan, spread_prefix_budget
from trace_lightning.allocation.allocators import KINDS, Allocator
from trace_lightning.tree import bare_reward
from trace_lightning.tree import RolloutTree
from builders.trees import chain_tree


def make_tree(tree_id: str, rollouts: list[tuple[int, float]], prediction: float = 0.5
              ) -> RolloutTree:
    """A tree of bare chains (``chain_tree``): ``(turns, reward)`` per rollout; non-leaf turns
    get ``prediction``."""
    return chain_tree(tree_id, [r for _, r in rollouts], turns=[n for n, _ in rollouts],
                      prefix_p=prediction, question=f"question {tree_id}")


def trees_for(plan, turns: int = 3) -> list[RolloutTree]:
    """Alternating rewards, ``turns`` turns per bare rollout, for every opened candidate."""
    return [make_tree(str(i), [(turns, float(j % 2)) for j in range(m)])
            for i, m in enumerate(plan.rollouts) if m > 0]


def allocator(kind, **kw) -> Allocator:
    args = dict(roots=8, continuations=2, max_rollouts_per_prompt=6, group_size=4, seed=0)
    args.update(kw)
    return Allocator(kind, **args)


def predictions(n: int) -> list[float]:
    return [(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("explore", [0.0, 0.5])
def test_every_kind_spends_the_same_leaves(kind, explore):
    alloc = allocator(kind, explore_fraction=explore)
    assert alloc.leaves_per_step == 8 * (1 + 2) == 24
    plan = alloc.plan_roots(20, predictions(20), predictor_nodes_seen=10**6)
    trees = trees_for(plan)
    prefixes = plan_prefixes(alloc, trees, cold_start=plan.cold_start)
    assert planned_leaves(plan, prefixes) == 24
    assert prefixes.unspent == 0
    assert all(m == 0 or 2 <= m <= 6 for m in plan.rollouts)
    for ti, t in enumerate(trees):  # node.continuations mirrors the plan
        for n in t.nodes:
            assert n.continuations == prefixes.continuations.get((ti, n.id), 0)


def test_uniform_and_random_tree_schedules():
    # uniform: L/G = 24/4 = 6 prompts of 4, the first of the list; random_tree: M/G = 2 of 4
    assert allocator("uniform").plan_roots(10).rollouts == [4] * 6 + [0] * 4
    plan = allocator("random_tree").plan_roots(10)
    assert plan.rollouts == [4, 4] + [0] * 8
    assert not any(plan.random_picks) and not plan.cold_start
    # random_tree: each prompt gets m_i N = 8 continuations over its 2 * 4 prefixes
    trees = trees_for(plan)
    out = plan_prefixes(allocator("random_tree"), trees)
    for ti in range(2):
        assert sum(c for (t, _), c in out.continuations.items() if t == ti) == 8


def test_prefix_kind_is_random_tree_roots_with_trace_prefixes():
    """``prefix`` opens random_tree's prompts (the first M/G of the list, whatever the
    predictions) and spends each prompt's m_i N continuations as trace does."""
    alloc = allocator("prefix")
    assert alloc.branches and alloc.predicts and not alloc.solves_roots
    assert alloc.root_budget == 8 and alloc.prompts_needed == 2 and alloc.n_explore == 0
    plan = alloc.plan_roots(10, None, predictor_nodes_seen=10**6)
    assert plan.rollouts == [4, 4] + [0] * 8 and not plan.cold_start
    # its stage 2 is trace's: the hand-derived trace tests below run for both kinds


def test_prompt_kind_filters_by_prediction():
    # budget L = 24 on v = [0, 1, 0.5, 0.5, 0.5, 0.5, 0.45]: only the five near 0.5 are
    # worth anything; m_max 6 -> 5 prompts can take all 24 (e.g. 6+6+4+4+4 or 5 x ~5)
    alloc = allocator("prompt")
    plan = alloc.plan_roots(7, [0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.45], predictor_nodes_seen=0)
    assert plan.rollouts[0] == plan.rollouts[1] == 0
    assert sum(plan.rollouts) == 24
    assert plan_prefixes(alloc, trees_for(plan)) == PrefixPlan()


def test_prediction_counts_reach_the_root_solver():
    # the same means, but prompts 0-1 are known-mixed (worth 8 rollouts) and 2-6 are vague
    # (worth 1): the plan opens the known ones first and gives them the most rollouts
    alloc = allocator("prompt")
    v = [0.45, 0.45, 0.5, 0.5, 0.5, 0.5, 0.5]
    point = alloc.plan_roots(7, v, predictor_nodes_seen=0)
    belief = allocator("prompt").plan_roots(7, v, predictor_nodes_seen=0,
                                            prediction_counts=[8.0, 8.0] + [1.0] * 5)
    assert point.rollouts[:2] != belief.rollouts[:2]
    assert min(belief.rollouts[:2]) >= max(belief.rollouts[2:]) and sum(belief.rollouts) == 24


def test_resting_prompts_stay_closed_while_the_others_can_take_the_budget():
    """Against brute force over the fresh candidates: trace's root budget M = 8 (m_max 6) on 6
    candidates, some resting; the plan's value is the best with every resting prompt at 0."""
    import itertools
    import random

    from trace_lightning.math.solvers import root_value

    rng = random.Random(0)
    for _ in range(40):
        v = [rng.choice([0.1, 0.3, 0.5, 0.7, rng.random()]) for _ in range(6)]
        resting = [rng.random() < 0.5 for _ in range(6)]
        plan = allocator("trace").plan_roots(6, v, resting=resting)
        fresh = resting.count(False)
        if fresh < 2:  # one prompt of at most 6 cannot take 8: every candidate may open
            assert plan.resting == 0 and plan == allocator("trace").plan_roots(6, v)
            continue
        assert plan.resting == 6 - fresh
        assert all(m == 0 for m, r in zip(plan.rollouts, resting) if r)
        best = max(sum(root_value(x, k) for x, k in zip(v, m))
                   for m in itertools.product([0, 2, 3, 4, 5, 6], repeat=6)
                   if sum(m) == 8 and not any(k and r for k, r in zip(m, resting)))
        assert sum(root_value(x, k) for x, k in zip(v, plan.rollouts)) == pytest.approx(best)
    # no flags, or none set: the plan of old; the uniform schedule ignores them
    v = predictions(6)
    assert allocator("trace").plan_roots(6, v, resting=[False] * 6) == \
        allocator("trace").plan_roots(6, v)
    assert allocator("uniform").plan_roots(6, resting=[True] * 6).rollouts == [4] * 6
    with pytest.raises(ValueError, match=r"resting \(2 values\) must give one flag per "
                                         r"candidate \(6\)"):
        allocator("trace").plan_roots(6, v, resting=[True, False])


def test_exploration_picks_only_prompts_that_do_not_rest():
    # 1 random prompt of 4 and the solver's 4 (explore 0.5); 20 of 30 candidates rest
    resting = [i % 3 != 0 for i in range(30)]
    for seed in range(10):
        plan = allocator("trace", explore_fraction=0.5, seed=seed).plan_roots(
            30, predictions(30), resting=resting)
        assert plan.resting == 20 and sum(plan.random_picks) == 1
        assert all(m == 0 for m, r in zip(plan.rollouts, resting) if r)


def test_cold_start_falls_back_to_uniform():
    for kind, expect in [("prompt", [4] * 6), ("trace", [4] * 2)]:
        alloc = allocator(kind, cold_start_nodes=100)
        plan = alloc.plan_roots(10, predictions(10), predictor_nodes_seen=99)
        assert plan.cold_start
        assert plan.rollouts == expect + [0] * (10 - len(expect))
        warm = alloc.plan_roots(10, predictions(10), predictor_nodes_seen=100)
        assert not warm.cold_start and warm.rollouts != plan.rollouts
    # a cold trace step branches at random yet spends the budget
    alloc = allocator("trace", cold_start_nodes=100)
    plan = alloc.plan_roots(10, None, predictor_nodes_seen=0)  # no predictions needed when cold
    trees = trees_for(plan)
    for t in trees:
        for n in t.prefixes():
            n.prediction = None  # random prefixes do not read predictions
    assert planned_leaves(plan, plan_prefixes(alloc, trees, cold_start=True)) == 24
    # a cold prefix step is a random_tree step: the same roots and the same random draws
    cold = allocator("prefix", cold_start_nodes=100)
    assert cold.is_cold(99) and not cold.is_cold(100)
    plan = cold.plan_roots(10, None, predictor_nodes_seen=99)
    assert plan.cold_start and plan.rollouts == [4, 4] + [0] * 8
    trees = trees_for(plan)
    for t in trees:
        for n in t.prefixes():
            n.prediction = None
    assert (plan_prefixes(cold, trees, cold_start=True)
            == plan_prefixes(allocator("random_tree"), trees_for(plan)))
    # the oracle never cold-starts
    assert not allocator("oracle", cold_start_nodes=100).plan_roots(
        10, predictions(10), 0).cold_start


def test_exploration_is_seeded_and_disjoint_from_the_solver():
    # trace, M = 8, explore 0.5 -> floor(0.5 * 8 / 4) = 1 random prompt of 4; solver spends 4
    def plan(seed):
        return allocator("trace", explore_fraction=0.5, seed=seed).plan_roots(
            30, predictions(30), predictor_nodes_seen=0)

    a, b = plan(3), plan(3)
    assert a == b
    assert sum(a.random_picks) == 1
    pick = a.random_picks.index(True)
    assert a.rollouts[pick] == 4
    solved = allocator("trace").plan_roots(30, predictions(30))  # the solver alone, budget 8
    assert sum(m for m, r in zip(a.rollouts, a.random_picks) if not r) == 4
    assert sum(solved.rollouts) == 8
    # across seeds the pick moves (30 candidates, one or two solved)
    assert len({plan(s).random_picks.index(True) for s in range(10)}) > 1


def test_exploration_picks_agree_across_ranks_after_rank_local_random_prefixes():
    """Ranks plan the same global roots but spread cold-start prefixes over their own trees
    (different counts): the next step's exploration picks must still agree, or a prompt
    would be rolled out on two ranks and another on none."""
    ranks = [allocator("trace", explore_fraction=0.5, cold_start_nodes=100, seed=5)
             for _ in range(2)]
    for alloc, n_trees in zip(ranks, (1, 2)):  # e.g. 3 opened prompts split rank 0::2, 1::2
        cold = alloc.plan_roots(30, None, predictor_nodes_seen=0)
        plan_prefixes(alloc, trees_for(cold)[:n_trees], cold_start=True)
    warm = [a.plan_roots(30, predictions(30), predictor_nodes_seen=100) for a in ranks]
    assert warm[0].random_picks == warm[1].random_picks and any(warm[0].random_picks)


def test_state_dict_round_trip_gives_the_same_next_plan():
    alloc = allocator("trace", explore_fraction=0.5, seed=11)
    alloc.plan_roots(30, predictions(30))
    state = alloc.state_dict()
    first = alloc.plan_roots(30, predictions(30))
    first_prefixes = plan_prefixes(alloc, trees_for(first), cold_start=True)  # RNG draws too
    fresh = allocator("trace", explore_fraction=0.5, seed=999)
    fresh.load_state_dict(state)
    assert fresh.plan_roots(30, predictions(30)) == first
    assert plan_prefixes(fresh, trees_for(first), cold_start=True) == first_prefixes


def test_random_prefixes_are_seeded_by_step_and_rank():
    """Each rank draws random prefixes over its own trees; a checkpoint holds rank 0's RNG
    only. Seeded from (seed, step, rank) at each step, a rank that resumes (whatever its RNG
    held) draws what an unbroken run draws, and ranks still draw apart."""
    plan = allocator("random_tree").plan_roots(20, None)
    unbroken, resumed = allocator("random_tree", seed=3), allocator("random_tree", seed=3)
    unbroken.start_step(0, rank=1)
    plan_prefixes(unbroken, trees_for(plan))  # step 0 moves this rank's RNG
    unbroken.start_step(1, rank=1)
    want = plan_prefixes(unbroken, trees_for(plan))
    resumed.start_step(1, rank=1)  # fresh RNG, as after loading rank 0's state
    assert plan_prefixes(resumed, trees_for(plan)) == want
    for step, rank in [(1, 0), (0, 1)]:  # other ranks and other steps draw otherwise
        other = allocator("random_tree", seed=3)
        other.start_step(step, rank)
        assert plan_prefixes(other, trees_for(plan)) != want


def test_single_turn_prompt_returns_its_budget_to_the_pool():
    alloc = allocator("trace")
    # prompt 0: two single-turn rollouts (no prefixes); prompt 1: two 3-turn rollouts
    trees = [make_tree("a", [(1, 0.0), (1, 1.0)]), make_tree("b", [(3, 0.0), (3, 1.0)])]
    out = plan_prefixes(alloc, trees)
    assert out.pool_returned == 2 * 2  # m_0 N = 4
    assert out.unspent == 0
    assert all(ti == 1 for ti, _ in out.continuations)
    assert out.leaves == (2 + 2) * 2
    # random_tree pools the same way
    out = plan_prefixes(allocator("random_tree"),
                        [make_tree("a", [(1, 0.0)] * 4), make_tree("b", [(2, 0.0)] * 4)])
    assert out.pool_returned == 8 and out.leaves == 16 and out.unspent == 0
    # nothing to branch from anywhere: the whole budget is reported unspent
    out = plan_prefixes(alloc, [make_tree("a", [(1, 0.0), (1, 1.0)])])
    assert out.leaves == 0 and out.unspent == 4 and out.pool_returned == 4


@pytest.mark.parametrize("kind", ["trace", "prefix"])
def test_trace_branches_failures_where_success_looked_likely(kind):
    # one tree, three 2-turn bare rollouts (one prefix each), N = 1 -> budget 3, no cap.
    # rollout 0 failed (r=0), p=0.9: q = 0.1, gains 0.9, 0.09, 0.009, ...
    # rollout 1 failed (r=0), p=0.1: q = 0.9, gains 0.1, 0.09, ...
    # rollout 2 succeeded (r=1), p=0.9: q = 0.9, gains 0.1, 0.09, ...
    # greedy: 0.9 (r0); 0.1 (r1; tie with r2 by index); 0.1 (r2) -> one each at budget 3.
    alloc = allocator(kind, continuations=1, roots=2, group_size=2)
    t = make_tree("x", [(2, 0.0), (2, 0.0), (2, 1.0)])
    for n in t.prefixes():
        n.prediction = {0: 0.9, 1: 0.1, 2: 0.9}[n.rollout]
    assert [bare_reward(t, j) for j in range(3)] == [0.0, 0.0, 1.0]
    out = plan_prefixes(alloc, [t])
    assert {t.nodes[i].rollout: c for (_, i), c in out.continuations.items()} == {0: 1, 1: 1, 2: 1}
    # two failed rollouts, p = 0.2 vs 0.8 (q = 0.8 vs 0.2, first gains 0.2 vs 0.8), budget 2:
    # 0.8 (high p), then 0.2 (low p, first unit) beats 0.16 (high p, second unit) -> [1, 1]
    # (the single-unit case, where only the high-p failure is branched, is the next test)
    two = make_tree("y", [(2, 0.0), (2, 0.0)])
    for n in two.prefixes():
        n.prediction = {0: 0.2, 1: 0.8}[n.rollout]
    out = plan_prefixes(alloc, [two])
    assert {two.nodes[i].rollout: c for (_, i), c in out.continuations.items()} == {0: 1, 1: 1}


def random_trees(rng, n: int) -> list[RolloutTree]:
    """``n`` trees of 1-4 bare rollouts, 1-3 turns each (some trees without a prefix), random
    rewards; predictions 0, 0.5 or 1, so that many prefixes tie."""
    trees = []
    for i in range(n):
        rollouts = [(int(rng.integers(1, 4)), float(rng.integers(2)))
                    for _ in range(int(rng.integers(1, 5)))]
        t = make_tree(f"t{i}", rollouts)
        for node in t.prefixes():
            node.prediction = float(rng.choice([0.0, 0.5, 1.0]))
        trees.append(t)
    return trees


@pytest.mark.parametrize("kind", ["trace", "prefix", "random_tree"])
@pytest.mark.parametrize("cap", [None, 1])
def test_planning_tree_by_tree_gives_the_one_shot_counts(kind, cap):
    """The per-prompt schedule (``plan`` on each turn's finished trees, in any order and
    grouping; the pool once all are planned) gives exactly the one-shot ``plan_prefixes``'
    counts over all trees at once (``references``), ties included; for trace and prefix
    those are ``spread_prefix_budget``'s, and for random_tree the draws do not depend on the
    finish order either."""
    import numpy as np

    for seed in range(30):
        rng = np.random.default_rng(seed)
        trees = random_trees(rng, 6)
        want = plan_prefixes(allocator(kind, max_continuations_per_prefix=cap), trees)
        per_node = {(t.tree_id, n.id): n.continuations for t in trees for n in t.prefixes()}
        for n in (n for t in trees for n in t.prefixes()):
            n.continuations = 0
        planner = allocator(kind, max_continuations_per_prefix=cap).prefix_planner(trees)
        order = list(rng.permutation(len(trees)))  # the order trees finish in
        got: dict[tuple[str, int], int] = {}
        for group in (order[:1], order[1:4], [], order[4:]):
            assert not planner.all_planned
            for t, node, k in planner.plan([trees[i] for i in group]):
                got[(t.tree_id, node)] = got.get((t.tree_id, node), 0) + k
        for t, node, k in planner.spend_pool():
            got[(t.tree_id, node)] = got.get((t.tree_id, node), 0) + k
        assert planner.pool_returned == want.pool_returned
        assert planner.unspent == want.unspent
        assert {k: c for k, c in per_node.items() if c} == got
        assert all(n.continuations == per_node[(t.tree_id, n.id)]
                   for t in trees for n in t.prefixes())
        budgets = [2 * len(t.bare_rollouts()) for t in trees]
        assert sum(got.values()) + planner.unspent == sum(budgets)  # conserved exactly
        if kind != "random_tree":
            pairs = [[(bare_reward(t, n.rollout), n.prediction) for n in t.prefixes()]
                     for t in trees]
            spread = spread_prefix_budget(pairs, budgets, cap)
            assert spread.counts == [[per_node[(t.tree_id, n.id)] for n in t.prefixes()]
                                     for t in trees]


def test_tied_prefixes_take_the_pool_in_step_order_whatever_finishes_first():
    """N = 1. Tree a has one single-turn rollout (no prefix): its 1 continuation goes to the
    pool. Trees b and c each have one 2-turn success whose prefix is predicted 0.5, so
    q = 0.5 and each takes its own 1 (gain 0.5). The pool's unit then ties (gain 0.25 on
    either) and goes to the earlier tree in step order, b, also when c finished first."""
    def step():
        return make_tree("a", [(1, 0.0)]), make_tree("b", [(2, 1.0)]), make_tree("c", [(2, 1.0)])

    a, b, c = step()
    want = plan_prefixes(allocator("trace", continuations=1), [a, b, c]).continuations
    assert want == {(1, 1): 2, (2, 1): 1}
    a, b, c = step()
    planner = allocator("trace", continuations=1).prefix_planner([a, b, c])
    planner.plan([c])
    planner.plan([a, b])
    assert planner.spend_pool() == [(b, 1, 1)]
    assert prefix_plan(planner).continuations == want


def test_the_pool_is_spent_once_after_every_tree():
    a, b = make_tree("a", [(1, 0.0), (1, 1.0)]), make_tree("b", [(2, 0.0)])
    planner = allocator("trace").prefix_planner([a, b])
    planner.plan([a])  # no prefix: 4 to the pool
    assert planner.pool_returned == 4 and not planner.pool_spent
    with pytest.raises(ValueError, match="every tree must be planned before spend_pool"):
        planner.spend_pool()
    with pytest.raises(ValueError, match="tree a is already planned"):
        planner.plan([a])
    with pytest.raises(ValueError, match="tree c is not one of the planner's trees"):
        planner.plan([make_tree("c", [(2, 0.0)])])
    (tree, node, k), = planner.plan([b])  # its own 2
    assert (tree.tree_id, node, k) == ("b", 1, 2) and planner.all_planned
    assert planner.spend_pool() == [(b, 1, 4)] and b.nodes[1].continuations == 6
    assert planner.plan([]) == []  # a turn only another rank reports on
    with pytest.raises(ValueError, match="once per step"):
        planner.spend_pool()
    with pytest.raises(ValueError, match="does not branch"):
        allocator("uniform").prefix_planner([a])


def test_unfinished_bare_rollout_is_rejected():
    t = make_tree("v", [(2, 0.0), (2, 0.0)])
    t.nodes[t.bare_rollouts()[0]].children.clear()  # chain cut before its leaf
    with pytest.raises(ValueError, match="stops at unfinished node"):
        plan_prefixes(allocator("trace"), [t])


@pytest.mark.parametrize("kind", ["trace", "prefix"])
def test_trace_prefers_high_p_failure_with_one_unit(kind):
    # a tree with one bare rollout (budget 1 * N, N = 1) holding two prefixes of a failure:
    # turn 1 predicted 0.3 (q = 0.7, gain 0.3), turn 2 predicted 0.9 (q = 0.1, gain 0.9)
    alloc = allocator(kind, continuations=1, roots=2, group_size=2)
    t = make_tree("u", [(3, 0.0)])
    t.nodes[1].prediction, t.nodes[2].prediction = 0.3, 0.9
    out = plan_prefixes(alloc, [t])
    assert out.continuations == {(0, 2): 1}
    assert t.nodes[2].continuations == 1 and t.nodes[1].continuations == 0
    # and a lucky success: turn 1 predicted 0.2 (q = 0.2, gain 0.8) beats turn 2 at 0.7 (0.3)
    t = make_tree("s", [(3, 1.0)])
    t.nodes[1].prediction, t.nodes[2].prediction = 0.2, 0.7
    assert plan_prefixes(alloc, [t]).continuations == {(0, 1): 1}


@pytest.mark.parametrize("kind", ["trace", "prefix"])
def test_trace_needs_predictions_on_prefixes(kind):
    t = make_tree("p", [(2, 0.0), (2, 1.0)])
    t.nodes[1].prediction = None
    with pytest.raises(ValueError, match=rf"no prediction.*\(kind '{kind}'\)"):
        plan_prefixes(allocator(kind), [t])


@pytest.mark.parametrize("kw, match", [
    (dict(kind="grpo"), r"kind \('grpo'\) is unknown; expected one of uniform, random_tree"),
    (dict(roots=1), r"roots \(1\) must be >= 2"),
    (dict(continuations=-1), r"continuations \(-1\) must be >= 0"),
    (dict(continuations=0), r"--data.allocator.continuations \(0\) must be >= 1 when kind is "
                            r"'trace'; set it or use kind 'prompt'"),
    (dict(kind="random_tree", continuations=0), r"when kind is 'random_tree'"),
    (dict(group_size=1), r"group_size \(1\) must be >= 2"),
    (dict(max_rollouts_per_prompt=1), r"max_rollouts_per_prompt \(1\) must be >= 2"),
    (dict(group_size=8), r"group_size \(8\) exceeds"),
    (dict(kind="random_tree", roots=6), r"roots \(6\) must be a multiple of "
                                        r"--data.allocator.group_size \(4\)"),
    (dict(kind="uniform", roots=5, continuations=1),
     r"--data.allocator.roots \* \(1 \+ --data.allocator.continuations\) \(10\) must be a "
     r"multiple"),
    (dict(roots=6, cold_start_nodes=10), r"cold start plans uniformly"),
    (dict(explore_fraction=1.0), r"explore_fraction \(1.0\) must be in \[0, 1\)"),
    (dict(max_continuations_per_prefix=0), r"max_continuations_per_prefix \(0\) must be >= 1"),
    (dict(prompts_per_step=1), r"cannot be spent exactly"),
    (dict(kind="uniform", prompts_per_step=2), r"prompts_per_step \(2\) is below the 6 prompts"),
    (dict(max_rollouts_per_prompt=2, group_size=2, roots=7, continuations=1),
     r"cannot be spent exactly"),
])
def test_bad_arguments_name_the_flag(kw, match):
    kind = kw.pop("kind", "trace")
    with pytest.raises(ValueError, match=match):
        allocator(kind, **kw)


def test_too_few_candidates_name_the_pool_flag():
    with pytest.raises(ValueError, match=r"--data.candidates_per_step \(5\) is below the 6"):
        allocator("uniform").plan_roots(5)
    with pytest.raises(ValueError, match=r"--data.candidates_per_step \(1\) is too small"):
        allocator("trace").plan_roots(1, [0.5])  # 1 prompt x 6 rollouts < 8
    # explore 0.5: 1 random prompt of 4, the solver spends 4. With 2 candidates it keeps to
    # one (4 rollouts) so the other can be explored, though opening both (2 + 2) scores more
    plan = allocator("trace", explore_fraction=0.5).plan_roots(2, [0.5, 0.5])
    assert sorted(plan.rollouts) == [4, 4] and sum(plan.random_picks) == 1
    with pytest.raises(ValueError, match=r"--data.candidates_per_step \(1\) is too small"):
        allocator("trace", explore_fraction=0.5).plan_roots(1, [0.5])
    # fewer candidates than exploration prompts (3 of 4 rollouts in 24): the pool flag, not
    # the solver's internals
    with pytest.raises(ValueError, match=r"--data.candidates_per_step \(2\) is below the 3 "
                                         r"exploration prompts"):
        Allocator("prompt", 8, 2, 6, 4, explore_fraction=0.5).plan_roots(2, [0.5] * 2, 10)
    # the fewest candidates each plans from (data.py checks the config against it)
    assert allocator("uniform").prompts_needed == 6  # 24 / 4
    assert allocator("trace", explore_fraction=0.5).prompts_needed == 2  # 4/6 -> 1, + 1
    assert allocator("trace", cold_start_nodes=10).prompts_needed == 2  # 8/6 -> 2; cold 8/4
    assert allocator("prompt", cold_start_nodes=10).prompts_needed == 6  # cold: 24 / 4
    for kind, kw in [("trace", {"explore_fraction": 0.5}), ("prompt", {"cold_start_nodes": 10}),
                     ("prompt", {"explore_fraction": 0.4})]:
        a = allocator(kind, **kw)
        n = a.prompts_needed
        a.plan_roots(n, predictions(n) if n > 1 else [0.5], predictor_nodes_seen=0)
        with pytest.raises(ValueError, match="candidates_per_step"):
            a.plan_roots(n - 1, predictions(n - 1) if n > 2 else [0.5] * (n - 1),
                         predictor_nodes_seen=0)
    with pytest.raises(ValueError, match=r"one prediction per candidate \(3\), got 2 values"):
        allocator("trace").plan_roots(3, [0.5, 0.5])
