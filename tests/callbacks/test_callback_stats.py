"""Hand-checked monitoring statistics (callbacks/_stats.py) on a hand-built step: the step
and the figures derived by hand from it are ``builders.steps`` (drawn in its docstring)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from callbacks._stats import (allocation_metrics, calibration_metrics, calibration_points,
                              gini, merge_summaries, normalized_entropy, reward_variance_metrics,
                              summarize_step)
from trace_lightning.math import calibration
from trace_lightning.tree import Budget
from builders.steps import (EXPECTED_ALLOC, EXPECTED_PREDICTOR, EXPECTED_ROLLOUT, add_turn,
                            build_step, build_trees)


def _check(got: dict, expected: dict) -> None:
    missing = sorted(set(expected) - set(got))
    assert not missing, f"missing keys {missing}"
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


# ---- generic functions ---------------------------------------------------------------------
def test_gini():
    # [4, 0, 0, 4]: |4-0| in 8 ordered pairs -> 32; 2 n^2 mean = 2 * 16 * 2 = 64 -> 0.5
    assert gini([4, 0, 0, 4]) == pytest.approx(0.5)
    assert gini([3, 3, 3]) == 0.0
    assert gini([0, 0]) == 0.0
    # one prompt takes everything of n: (n - 1) / n
    assert gini([8, 0, 0, 0]) == pytest.approx(0.75)
    assert math.isnan(gini([]))
    with pytest.raises(ValueError):
        gini([1, -1])


def test_normalized_entropy():
    # [4, 0, 0, 4]: H = ln 2 over ln 4 = 0.5 (zeros count in n)
    assert normalized_entropy([4, 0, 0, 4]) == pytest.approx(0.5)
    assert normalized_entropy([2, 2, 2, 2]) == pytest.approx(1.0)
    assert normalized_entropy([5, 0, 0]) == pytest.approx(0.0)
    assert normalized_entropy([7]) == 1.0
    assert math.isnan(normalized_entropy([])) and math.isnan(normalized_entropy([0, 0]))


# ---- on the hand-built step ----------------------------------------------------------------
def test_reward_variance_on_hand_built_step():
    _check(reward_variance_metrics(summarize_step(build_step())), EXPECTED_ROLLOUT)


def test_allocation_on_hand_built_step():
    scalars, hists = allocation_metrics(summarize_step(build_step()))
    _check(scalars, EXPECTED_ALLOC)
    assert sorted(hists["alloc/leaves_per_prompt"]) == [3, 3, 4]
    assert sorted(hists["alloc/continuations_per_prefix"]) == [1, 1, 2]
    assert sorted(hists["alloc/branch_depth"]) == [1, 1, 2]


def test_calibration_on_hand_built_step_matches_library():
    pts = calibration_points(build_step().trees)
    got = calibration_metrics(pts)
    _check(got, EXPECTED_PREDICTOR)
    # the numbers flow through trace_lightning.math.calibration unchanged
    assert got["predictor/brier"] == calibration.brier(pts.p, pts.y, pts.w)
    assert got["predictor/ece"] == calibration.expected_calibration_error(pts.p, pts.y, pts.w)


def test_calibration_skill_against_the_last_step_mean_by_hand():
    """With the last step's mean outcomes as the constants to beat: roots at .5 score
    (4 * 0 + 3 * .25 + 3 / 36) / 10 = 1/12, prefixes at 0 score their mean square
    (3 / 9 + 2 / 4) / 10 = 1/12; all nodes at .25 score (Brier 0 + .25^2 over 20 leaves)."""
    pts = calibration_points(build_step().trees)
    assert "predictor/roots/brier_skill_vs_previous" not in calibration_metrics(pts)
    got = calibration_metrics(pts, previous={"predictor/roots/outcome_mean": 0.5,
                                             "predictor/prefixes/outcome_mean": 0.0,
                                             "predictor/outcome_mean": 0.25})
    assert got["predictor/roots/brier_skill_vs_previous"] == pytest.approx(1 - (2 / 150) * 12)
    assert got["predictor/prefixes/brier_skill_vs_previous"] == pytest.approx(
        1 - (49 / 1200) * 12)
    # a constant at the nodes' own mean (.25) is the hindsight baseline: the same skill
    assert got["predictor/brier_skill_vs_previous"] == pytest.approx(got["predictor/brier_skill"])
    # one part missing from `previous`: only that part goes without
    only_roots = calibration_metrics(pts, previous={"predictor/roots/outcome_mean": 0.5})
    assert "predictor/prefixes/brier_skill_vs_previous" not in only_roots
    assert "predictor/roots/brier_skill_vs_previous" in only_roots


def test_split_over_ranks_merges_to_the_same_metrics():
    """Two ranks holding {A, B} and {C} give, merged, the one-process numbers."""
    a, b, c = build_trees()
    r0 = build_step(trees=[a, b])
    r1 = build_step(trees=[c])
    r1.budget, r0.budget = Budget(leaves=3, generated_tokens=200, prefill_tokens=300,
                                  cached_tokens=50, tool_calls=2), \
        Budget(leaves=7, generated_tokens=300, prefill_tokens=500, cached_tokens=150, tool_calls=4)
    r0.pool_returned, r1.pool_returned = 1, 0
    r0.engine_calls, r1.engine_calls = 5, 9
    merged = merge_summaries([summarize_step(r0), summarize_step(r1)])
    assert merged.engine_calls == 9  # ranks run their turns side by side: the longest
    _check(reward_variance_metrics(merged), EXPECTED_ROLLOUT)
    _check(allocation_metrics(merged)[0], EXPECTED_ALLOC)
    # a mean of the ranks' effective ratios would be (1/2 + 1) / 2 = .75, not 2/3
    assert reward_variance_metrics(summarize_step(r0))["rollout/effective_ratio"] == 0.5


def test_bare_share_leaves_out_bare_rollouts_that_respent_unused_budget():
    """B gets a third bare rollout (index 2) that succeeds, from continuation budget no prefix
    could take: the tree is mixed, but stage 1 (B's planned 2 rollouts, {0, 0}) was not."""
    trees = build_trees()
    add_turn(trees[1], 0, 2, action="answer", reward=1.0, f1=1.0)
    step = build_step(trees=trees)
    step.stage1 = [2, 2, 2]
    got = reward_variance_metrics(summarize_step(step))
    assert got["rollout/zero_std_share_bare"] == pytest.approx(2 / 3)  # B and C, as before
    assert got["rollout/effective_ratio"] == pytest.approx(1.0)  # B's tree is mixed now
    step.stage1 = []  # unknown (a step built without it): every bare rollout counts
    assert reward_variance_metrics(summarize_step(step))["rollout/zero_std_share_bare"] \
        == pytest.approx(1 / 3)


def test_empty_and_uniform_steps_log_what_is_defined():
    empty = summarize_step(build_step(trees=[], root_plan=[0] * 5))
    assert reward_variance_metrics(empty) == {}
    scalars, hists = allocation_metrics(empty)
    assert hists == {} and scalars["alloc/prompts_filtered"] == 5
    assert all(math.isfinite(v) or k == "alloc/root_gini" for k, v in scalars.items())
    # no predictions (uniform allocator, cold start): no predictor metrics
    assert calibration_metrics(calibration_points(build_step(predictions=False).trees)) == {}
    # one all-failure prompt: no contrast anywhere
    got = reward_variance_metrics(summarize_step(build_step(trees=[build_trees()[1]])))
    assert got["rollout/zero_std_share"] == 1.0 and got["rollout/informative_leaf_share"] == 0.0
    assert np.isclose(got["rollout/prompt_reward_std_max"], 0.0)
