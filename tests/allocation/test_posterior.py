"""PrefixPosterior: prefix predictions updated by the prompt's bare outcomes, fitted online on
continuations' success rates (hand-derived values, and recovery of a known correction)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_lightning.allocation.posterior import (IDENTITY, PrefixPosterior, apply,
                                                  fit_logistic, inputs)
from trace_lightning.tree import RolloutTree


def tree(rewards: list[float], p: float = 0.5) -> RolloutTree:
    """Bare chains of two turns (a prefix, then the answer) with the given rewards."""
    t = RolloutTree.new("t", "q", ["a"], prompt_ids=[1, 2])
    for j, r in enumerate(rewards):
        first = t.add_child(0, rollout=j, token_ids=[3], logprobs=[-0.1], policy_mask=[1],
                            prediction=p)
        t.add_child(first.id, token_ids=[4], logprobs=[-0.1], policy_mask=[1], finished=True,
                    reward=r)
    return t


def test_inputs_by_hand():
    # logit(0.5) = 0; own success: +1; siblings 0, 1, 1: 2 * 2/3 - 1 = 1/3; the bias 1
    assert inputs(0.5, 1.0, [0.0, 1.0, 1.0]) == pytest.approx([0.0, 1.0, 1 / 3, 1.0])
    # no siblings: s = 0.5, the siblings' input 0; logit(0.8) = ln 4
    assert inputs(0.8, 0.0, []) == pytest.approx([math.log(4), -1.0, 0.0, 1.0])


def test_fit_logistic_by_hand():
    # one constant input, mean target 0.75, no penalty: theta = logit(0.75) = ln 3
    x = np.ones((4, 1))
    y = np.array([1.0, 1.0, 0.5, 0.5])
    theta = fit_logistic(x, y, np.ones(4), l2=0.0, prior=np.zeros(1))
    assert theta[0] == pytest.approx(math.log(3), abs=1e-8)
    # a huge penalty keeps the prior
    theta = fit_logistic(x, y, np.ones(4), l2=1e6, prior=np.array([0.2]))
    assert theta[0] == pytest.approx(0.2, abs=1e-4)


def test_fit_recovers_a_known_correction():
    rng = np.random.default_rng(0)
    n = 4000
    x = np.c_[rng.normal(0, 1.5, n), rng.choice([-1.0, 1.0], n), rng.uniform(-1, 1, n),
              np.ones(n)]  # (N, 4)
    truth = np.array([0.6, 1.5, 0.8, -0.3])
    y = (rng.random(n) < apply(truth, x)).astype(float)
    theta = fit_logistic(x, y, np.ones(n), l2=0.0)
    assert theta == pytest.approx(truth, abs=0.15)


def test_adjust_waits_for_every_bare_rollout_and_applies_the_correction():
    post = PrefixPosterior()
    t = tree([1.0, 0.0], p=0.5)
    t.nodes[-1].finished, t.nodes[-1].reward = False, None  # rollout 1 still running
    post.adjust([t])
    assert [n.prediction for n in t.prefixes()][:1] == [0.5]  # untouched until all end
    t = tree([1.0, 0.0], p=0.5)
    post.adjust([t])  # the identity
    assert [n.prediction for n in t.prefixes()] == pytest.approx([0.5, 0.5])
    post.theta = np.array([1.0, 2.0, 0.0, 0.0])  # own success +2 logits, failure -2
    t = tree([1.0, 0.0], p=0.5)
    post.adjust([t])
    s2 = 1 / (1 + math.exp(-2))
    assert [n.prediction for n in t.prefixes()] == pytest.approx([s2, 1 - s2])


def test_scored_rows_are_the_continuations_rates_and_the_fit_learns_from_them():
    post = PrefixPosterior(min_rows=2)
    trees = [tree([1.0, 0.0], p=0.5) for _ in range(2)]
    post.adjust(trees)
    for t in trees:  # continuations copy their own rollout's outcome
        for n in t.prefixes():
            own = t.nodes[n.children[0]].reward
            for _ in range(3):
                t.add_child(n.id, token_ids=[5], logprobs=[-0.1], policy_mask=[1],
                            finished=True, reward=own)
    rows = post.scored(trees)
    # x = [logit 0.5, own, siblings, 1], rate, count: own 1 with a failed sibling, and back
    assert sorted(map(tuple, rows)) == [(0.0, -1.0, 1.0, 1.0, 0.0, 3.0)] * 2 + \
        [(0.0, 1.0, -1.0, 1.0, 1.0, 3.0)] * 2
    assert post.scored(trees) == []  # the step's reads are forgotten once scored
    stats = post.fit(rows)
    assert stats["predictor/posterior_own"] > 1.0  # the own outcome carries the label here
    t = tree([1.0, 0.0], p=0.5)
    post.adjust([t])
    assert t.prefixes()[0].prediction > 0.8 and t.prefixes()[1].prediction < 0.2
    restored = PrefixPosterior(min_rows=2)
    restored.load_state_dict(post.state_dict())
    assert restored.theta == pytest.approx(post.theta)


def test_few_rows_keep_the_identity():
    post = PrefixPosterior(min_rows=20)
    post.fit([[0.0, 1.0, 0.0, 1.0, 1.0, 1.0]] * 5)
    assert post.theta == pytest.approx(IDENTITY)
