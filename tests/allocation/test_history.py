"""PromptHistory: hand-checked posteriors, decay, the bare-rollout rule, state round trip."""

from __future__ import annotations

import pytest

from trace_lightning.allocation.history import PromptHistory
from trace_lightning.tree import RolloutTree

from builders.trees import tree_with_continuations

KW = dict(token_ids=[7], logprobs=[-1.0], policy_mask=[1])


def test_outcomes_count_bare_rollouts_only():
    # bare paths end at a1 (0), b1 (1), c (0); the continuations a2, b2 (both 1) are left out
    assert PromptHistory.outcomes_of([tree_with_continuations()], step=4) == [("q1", 4, 1.0, 3.0)]


def test_posterior_hand_checked_with_decay():
    h = PromptHistory(strength=2.0, decay=0.5)
    h.record(PromptHistory.outcomes_of([tree_with_continuations("q1")], step=3))
    # step 3: s = 1, n = 3 -> v = (2 * 0.4 + 1) / (2 + 3) = 1.8 / 5 = 0.36
    assert h.posterior("q1", 0.4, step=3) == pytest.approx(0.36)
    # two steps later the counts weigh 0.5^2: s = 0.25, n = 0.75 -> (0.8 + 0.25) / 2.75
    assert h.posterior("q1", 0.4, step=5) == pytest.approx(1.05 / 2.75)
    # a new record at step 5 adds to the decayed counts: s = 0.25 + 2, n = 0.75 + 2
    h.record([("q1", 5, 2.0, 2.0)])
    assert h.counts("q1", 5) == pytest.approx((2.25, 2.75))
    assert h.posterior("q1", 0.4, step=5) == pytest.approx((0.8 + 2.25) / 4.75)
    # a prompt never seen keeps its prediction
    assert h.posterior("other", 0.4, step=5) == 0.4


def test_adjust_moves_roots_only_and_separates_failing_from_mixed_prompts():
    h = PromptHistory(strength=2.0, decay=1.0, belief=True)
    h.record([("always_fails", 0, 0.0, 4.0), ("mixed", 0, 2.0, 4.0)])
    trees = [RolloutTree.new(i, "q?", ["x"], [1]) for i in ("always_fails", "mixed", "new")]
    for t in trees:
        t.root.prediction = 0.3
    prefix = trees[0].add_child(0, rollout=0, **KW)
    prefix.prediction = 0.3
    h.adjust(trees, step=1)
    # (2 * 0.3 + 0) / 6 = 0.1; (2 * 0.3 + 2) / 6 = 0.4333; never seen: 0.3
    assert [t.root.prediction for t in trees] == pytest.approx([0.1, 2.6 / 6, 0.3])
    # each posterior is worth strength + n rollouts; a prompt never seen, strength alone
    assert [t.root.prediction_count for t in trees] == [6.0, 6.0, 2.0]
    # belief=False: the same means, handed over as exact predictions
    for t in trees:
        t.root.prediction, t.root.prediction_count = 0.3, None
    point = PromptHistory(strength=2.0, decay=1.0, belief=False)
    point.record([("always_fails", 0, 0.0, 4.0)])
    point.adjust(trees[:1], step=1)
    assert trees[0].root.prediction == pytest.approx(0.1)
    assert trees[0].root.prediction_count is None
    assert prefix.prediction == 0.3


def test_rest_marks_prompts_rolled_out_within_the_last_steps():
    h = PromptHistory(strength=1.0, decay=0.9, rest=2)
    h.record([("a", 3, 1.0, 2.0), ("b", 1, 0.0, 2.0)])
    # a, rolled out at step 3, rests at steps 4 and 5 and may open at 6; b rests through 3
    assert [h.resting("a", t) for t in (3, 4, 5, 6)] == [False, True, True, False]
    assert [h.resting("b", t) for t in (2, 3, 4)] == [True, True, False]
    assert not h.resting("never_seen", 4)
    assert not PromptHistory(rest=0).resting("a", 4)  # the default never rests
    trees = [RolloutTree.new(i, "q?", ["x"], [1]) for i in ("a", "b", "new")]
    trees[0].root.prediction = 0.3  # with or without a prediction, the flag is set
    h.adjust(trees, step=4)
    assert [t.root.resting for t in trees] == [True, False, False]
    h.adjust(trees, step=6)
    assert [t.root.resting for t in trees] == [False, False, False]


def test_state_round_trip(caplog):
    h = PromptHistory(strength=3.0, decay=0.9, belief=True)
    h.record([("a", 2, 1.0, 4.0), ("b", 3, 0.0, 2.0)])
    g = PromptHistory(strength=3.0, decay=0.9, belief=True)
    g.load_state_dict(h.state_dict())
    assert len(g) == 2 and g.posterior("a", 0.5, 4) == h.posterior("a", 0.5, 4)
    assert not caplog.records
    # a resumed run with other settings keeps its own and says so: counts (1, 4) at step 2,
    # one step of decay 0.9 later (0.9, 3.6); strength 1: (1 * 0.5 + 0.9) / (1 + 3.6)
    k = PromptHistory(strength=1.0, decay=0.9, belief=False, rest=2)
    k.load_state_dict(h.state_dict())
    assert (k.strength, k.decay, k.belief, k.rest) == (1.0, 0.9, False, 2)
    assert k.posterior("a", 0.5, 3) == pytest.approx((0.5 + 0.9) / 4.6)
    assert all(name in caplog.text for name in ("strength", "belief", "rest"))


@pytest.mark.parametrize("kw, match", [
    (dict(strength=0.0), "strength"), (dict(strength=float("nan")), "strength"),
    (dict(decay=0.0), "decay"), (dict(decay=1.5), "decay"),
    (dict(rest=-1), r"rest \(-1\) must be a whole number"), (dict(rest=1.5), "rest"),
    (dict(rest=True), "rest"),
])
def test_bad_settings_name_the_setting(kw, match):
    with pytest.raises(ValueError, match=match):
        PromptHistory(**kw)
