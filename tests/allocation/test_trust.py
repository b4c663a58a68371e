"""Trust: the allocator follows its predictions as far as their measured skill goes.

Hand-derived skills and weights; the plan's shares by hand; and the shrinkage end to end on
a simulated world of prompts with known success rates, for a predictor that returns the
truth and one that returns noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_lightning.allocation.allocators import Allocator
from trace_lightning.allocation.trust import Trust, continuation_rewards, outcomes, trust_weight
from trace_lightning.math.solvers import solve_prefixes
from trace_lightning.tree import RolloutTree
from builders.trees import chain_tree


def continue_from(t: RolloutTree, node_id: int, rewards: list[float]) -> None:
    t.nodes[node_id].continuations = len(rewards)
    for r in rewards:
        t.add_child(node_id, token_ids=[4], logprobs=[-0.1], policy_mask=[1], finished=True,
                    reward=r)


def test_trust_weight_by_hand():
    assert trust_weight(0.05, 0.2) == pytest.approx(0.25)
    assert trust_weight(0.3, 0.2) == 1.0  # more skill than needed: full trust
    assert trust_weight(-0.4, 0.2) == 0.0  # worse than the constant: none
    assert trust_weight(float("nan"), 0.2) == 0.0  # nothing measured yet: none


def test_outcomes_score_roots_on_stage1_and_prefixes_on_their_continuations():
    # root predicted 0.3, stage-1 rollouts 1 and 0 (2 turns each), a third bare rollout added
    # after planning (budget no prefix took) does not count; the prefix of rollout 0 (node 1,
    # predicted 0.6) got continuations 1, 1: its own rollout's 1 is not counted
    t = chain_tree("a", [1.0, 0.0, 1.0], turns=2, root_p=0.3, prefix_p=0.6)
    continue_from(t, 1, [1.0, 1.0])
    assert continuation_rewards(t, 1) == [1.0, 1.0]
    got = outcomes([t], stage1=[2])
    assert got["roots"] == [(0.3, 0.5, 2.0)]
    assert got["prefixes"] == [(0.6, 1.0, 2.0)]  # node 3 and 5 got no continuations


def test_pooled_skill_by_hand():
    # predictions 0.2 and 0.8 for rates 0 and 1 (one rollout each): Brier (0.04 + 0.04) / 2 =
    # 0.04; the constant 0.5 scores 0.25; skill 1 - 0.04 / 0.25 = 0.84
    trust = Trust(full_trust_skill=0.42, window=2)
    trust.record([chain_tree("x", [0.0, 0.0], root_p=0.2),
                  chain_tree("y", [1.0, 1.0], root_p=0.8)], stage1=[1, 1])
    assert trust.skill("roots") == pytest.approx(0.84)
    assert trust.weight("roots") == 1.0
    assert math.isnan(trust.skill("prefixes")) and trust.weight("prefixes") == 0.0
    # a step of predictions 0.8 for 0 and 0.2 for 1 joins the window: Brier 0.64 there; pooled
    # (0.04 + 0.04 + 0.64 + 0.64) / 4 = 0.34 against 0.25: skill -0.36, weight 0
    trust.record([chain_tree("x", [0.0], root_p=0.8), chain_tree("y", [1.0], root_p=0.2)],
                 stage1=[1, 1])
    assert trust.skill("roots") == pytest.approx(1 - 0.34 / 0.25)
    assert trust.weight("roots") == 0.0
    # two more good steps push the bad one out of the window (2 steps)
    for _ in range(2):
        trust.record([chain_tree("x", [0.0], root_p=0.2), chain_tree("y", [1.0], root_p=0.8)],
                     stage1=[1, 1])
    assert trust.skill("roots") == pytest.approx(0.84)
    restored = Trust(0.42, window=2)
    restored.load_state_dict(trust.state_dict())
    assert restored.skill("roots") == pytest.approx(0.84)


def trace(**kw) -> Allocator:
    args = dict(roots=8, continuations=1, max_rollouts_per_prompt=8, group_size=4,
                full_trust_skill=1.68, seed=0)  # a skill of 0.84 earns a weight of 0.5
    args.update(kw)
    return Allocator("trace", **args)


def earn(allocator: Allocator, skill: str) -> None:
    """Record one step whose root (and prefix) predictions score ``skill``: 'half' (0.84,
    weight 0.5 at full_trust_skill 1.68), 'none' (-0.36) or 'full' (1)."""
    good, bad = ((0.2, 0.8), (0.8, 0.2))
    pairs = {"half": [good], "none": [good, bad, bad], "full": [(0.0, 1.0)]}[skill]
    trees = []
    for i, (p0, p1) in enumerate(pairs):
        for name, p, r in ((f"x{i}", p0, 0.0), (f"y{i}", p1, 1.0)):
            t = chain_tree(name, [r], turns=2, root_p=p, prefix_p=p)
            continue_from(t, 1, [r])
            trees.append(t)
    allocator.record_outcomes(trees, [1] * len(trees))


def test_root_plan_shares_by_hand():
    preds = [0.5] + [0.01] * 11  # the solver puts everything on the first candidate
    # nothing measured: weight 0, both groups of G = 4 go to random prompts (random_tree)
    a = trace()
    plan = a.plan_roots(12, preds, predictor_nodes_seen=10**6)
    assert sorted(m for m in plan.rollouts if m) == [4, 4] and sum(plan.random_picks) == 2
    # weight 0.5: floor(0.5 * 8 / 4) = 1 random group, the solver spends the other 4
    a = trace()
    earn(a, "half")
    assert a.weight("roots") == pytest.approx(0.5)
    plan = a.plan_roots(12, preds, predictor_nodes_seen=10**6)
    assert plan.rollouts[0] == 4 and not plan.random_picks[0]
    assert sum(plan.random_picks) == 1 and sum(plan.rollouts) == 8
    # full trust (a skill of 1 against 0.5 needed): the solver alone (all 8 on the first)
    a = trace(full_trust_skill=0.5)
    earn(a, "full")
    assert a.weight("roots") == 1.0
    plan = a.plan_roots(12, preds, predictor_nodes_seen=10**6)
    assert plan.rollouts[0] == 8 and sum(plan.random_picks) == 0
    # without full_trust_skill, trust is not measured at all: the solver alone
    plan = trace(full_trust_skill=None).plan_roots(12, preds, predictor_nodes_seen=10**6)
    assert plan.rollouts[0] == 8


def prefix_trees() -> list[RolloutTree]:
    """Two prompts of two 3-turn bare rollouts (rewards 0, 1): 4 prefixes each, predictions
    that make the solver prefer the first prefix of the failed rollout."""
    trees = []
    for i in range(2):
        t = chain_tree(f"t{i}", [0.0, 1.0], turns=3, prefix_p=0.5)
        for n, p in zip(t.prefixes(), (0.9, 0.5, 0.9, 0.9)):
            n.prediction = p
        trees.append(t)
    return trees


def plan(allocator: Allocator, trees: list[RolloutTree]) -> list[list[int]]:
    planner = allocator.prefix_planner(trees)
    planner.plan(trees)
    planner.spend_pool()
    return [[n.continuations for n in t.prefixes()] for t in trees]


def test_prefix_plan_shares_by_hand():
    trees = prefix_trees()
    pairs = [(0.0, 0.9), (0.0, 0.5), (1.0, 0.9), (1.0, 0.9)]
    solved = solve_prefixes([r for r, _ in pairs], [p for _, p in pairs], 1)
    # full trust: the solver's counts exactly (budget 2 rollouts x 1 continuation = 2)
    a = trace(continuations=1, full_trust_skill=0.5)
    earn(a, "full")
    assert a.weight("prefixes") == 1.0
    assert plan(a, trees) == [solve_prefixes([r for r, _ in pairs], [p for _, p in pairs], 2)] * 2
    # weight 0.5: 0.5 x 2 = 1 continuation solved, 1 at random, per prompt
    a = trace(continuations=1)
    earn(a, "half")
    for counts in plan(a, prefix_trees()):
        assert sum(counts) == 2
        assert all(c >= s for c, s in zip(counts, solved))
    # no trust: the counts read no prediction (the same whatever the predictions say)
    flipped = prefix_trees()
    for t in flipped:
        for n in t.prefixes():
            n.prediction = 1.0 - n.prediction
    a, b = trace(continuations=1), trace(continuations=1)
    assert plan(a, prefix_trees()) == plan(b, flipped)


def simulate(predict: str, steps: int = 4) -> list[tuple[float, list[bool], list[int]]]:
    """Steps of trace on 64 candidates of known success rates (half near 0 or 1, half in
    between), single-turn rollouts drawn from them; the predictor returns the truth or
    uniform noise. Returns (root weight, random picks, rollouts) per step."""
    rng = np.random.default_rng(0)
    v = np.concatenate([rng.choice([0.02, 0.98], 32), rng.uniform(0.3, 0.7, 32)])
    a = Allocator("trace", roots=32, continuations=1, max_rollouts_per_prompt=8,
                  group_size=4, full_trust_skill=0.2, seed=0)
    out = []
    for _ in range(steps):
        preds = v if predict == "truth" else rng.uniform(0, 1, len(v))
        w = a.weight("roots")
        plan = a.plan_roots(len(v), list(preds), predictor_nodes_seen=10**6)
        trees = [chain_tree(str(i), list(map(float, rng.random(m) < v[i])), root_p=preds[i])
                 for i, m in enumerate(plan.rollouts) if m]
        a.record_outcomes(trees, [m for m in plan.rollouts if m])
        out.append((w, plan.random_picks, plan.rollouts))
    return out


def test_a_noise_predictor_is_shrunk_to_random_tree_and_the_truth_is_followed():
    noise, truth = simulate("noise"), simulate("truth")
    # the first informed step has no measured skill: both plan as random_tree does
    for w, picks, rollouts in (noise[0], truth[0]):
        assert w == 0.0 and sum(picks) == 8 and sorted(set(rollouts)) == [0, 4]
    # then noise earns nothing: every step is random_tree's plan, 8 random prompts of G = 4
    for w, picks, rollouts in noise[1:]:
        assert w == 0.0 and sum(picks) == 8 and sorted(set(rollouts)) == [0, 4]
    # the truth earns full trust: the solver plans it all, on the mixed prompts only
    for w, picks, rollouts in truth[1:]:
        assert w == 1.0 and sum(picks) == 0
        opened = [i for i, m in enumerate(rollouts) if m]
        assert all(i >= 32 for i in opened)  # never a prompt near 0 or 1


def test_bad_settings_name_the_flag():
    with pytest.raises(ValueError, match="full_trust_skill"):
        trace(full_trust_skill=0.0)
    with pytest.raises(ValueError, match="skill_window"):
        trace(skill_window=0)
