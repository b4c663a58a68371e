"""Hand-checked tree advantages, and loop references against the vectorised versions."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import references
from trace_lightning.math import advantage as adv
from trace_lightning.tree import RolloutTree

RTOL, ATOL = 1e-6, 1e-6


def turn(tokens, policy, reward=None):
    """Fields of one turn: ``policy`` = 1/0 per token; behaviour log-probs -0.5 on policy ones."""
    fields = dict(token_ids=list(tokens), policy_mask=list(policy),
                  logprobs=[-0.5 if m else 0.0 for m in policy])
    if reward is not None:
        fields.update(finished=True, finish_reason="answer", reward=float(reward))
    return fields


def hand_tree(r2=1.0, r3=0.0, r4=0.0, tree_id="a"):
    """The tree of every hand derivation below::

        root [1, 2] (prompt)
        |- n1 rollout 0: [3, 4 | 5]  (policy 3, 4; observation 5)
        |   |- n2 leaf: [6, 7]  reward r2
        |   |- n3 leaf: [8]     reward r3   (a continuation from prefix n1)
        |- n4 rollout 1 leaf: [9, 10]  reward r4
    """
    t = RolloutTree.new(tree_id, "q?", ["a"], prompt_ids=[1, 2])
    t.add_child(0, rollout=0, **turn([3, 4, 5], [1, 1, 0]))
    t.add_child(1, **turn([6, 7], [1, 1], reward=r2))
    t.add_child(1, **turn([8], [1], reward=r3))
    t.add_child(0, rollout=1, **turn([9, 10], [1, 1], reward=r4))
    t.compute_values()
    return t


# Rewards {n2: 1, n3: 0, n4: 0}.
# Prompt group {1, 0, 0}: mean 1/3; unbiased var ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std 0.577350.
#   norm: n2 (2/3)/0.577350 = 1.154700; n3, n4 (-1/3)/0.577350 = -0.577350.
# Subtree rollout 0 = {n2: 1, n3: 0}: mean 0.5, var (0.25 + 0.25)/1 = 0.5, std 0.707107.
#   norm: n2 +0.707107, n3 -0.707107.
# Subtree rollout 1 = {n4: 0}: group of one, mean 0 std 1 -> 0 / (1 + eps) = 0.
# Exact forms (std + eps in the denominator) for tight tolerances:
E = adv.EPS
PROMPT = {2: (2 / 3) / (math.sqrt(1 / 3) + E), 3: (-1 / 3) / (math.sqrt(1 / 3) + E),
          4: (-1 / 3) / (math.sqrt(1 / 3) + E)}
SUB = {2: 0.5 / (math.sqrt(0.5) + E), 3: -0.5 / (math.sqrt(0.5) + E), 4: 0.0}


def test_tree_grpo_by_hand():
    got = adv.tree_grpo([hand_tree()])
    # n2 = 1.154700 + 0.707107 = 1.861807; n3 = -0.577350 - 0.707107 = -1.284457;
    # n4 = -0.577350 + 0 = -0.577350.
    expected = {2: 1.861807, 3: -1.284457, 4: -0.577350}
    for leaf, value in expected.items():
        assert got[("a", leaf)] == pytest.approx(value, rel=1e-5, abs=1e-5)
        assert got[("a", leaf)] == pytest.approx(PROMPT[leaf] + SUB[leaf], rel=RTOL, abs=ATOL)


def test_tree_grpo_group_of_one_keeps_reward():
    # Rewards {n2: 0, n3: 0, n4: 1}. Rollout 1 is a group of one: mean 0, std 1 -> 1/(1+1e-6).
    # Prompt group {0, 0, 1}: n4 gets (2/3)/0.577350 = 1.154700, n2, n3 get -0.577350.
    # Rollout 0 {0, 0}: all equal -> 0.
    got = adv.tree_grpo([hand_tree(r2=0.0, r3=0.0, r4=1.0)])
    assert got[("a", 4)] == pytest.approx(1.154700 + 1 / (1 + 1e-6), rel=1e-5, abs=1e-5)
    assert got[("a", 2)] == pytest.approx(-0.577350, rel=1e-5, abs=1e-5)
    assert got[("a", 3)] == pytest.approx(-0.577350, rel=1e-5, abs=1e-5)


def test_all_equal_rewards_zero_prompt_term():
    # Rewards {1, 1, 1}: prompt term 0 for all; rollout 0 {1, 1} -> 0; rollout 1 {1} lone -> 1.
    t = hand_tree(1.0, 1.0, 1.0)
    assert adv.grpo([t]) == pytest.approx({("a", 2): 0.0, ("a", 3): 0.0, ("a", 4): 0.0}, abs=ATOL)
    got = adv.tree_grpo([t])
    assert got[("a", 2)] == pytest.approx(0.0, abs=ATOL)
    assert got[("a", 3)] == pytest.approx(0.0, abs=ATOL)
    assert got[("a", 4)] == pytest.approx(1.0, abs=1e-5)


def test_grpo_by_hand_and_without_std():
    got = adv.grpo([hand_tree()])
    for leaf in (2, 3, 4):
        assert got[("a", leaf)] == pytest.approx(PROMPT[leaf], rel=RTOL, abs=ATOL)
    # Dr. GRPO: mean-centre only: n2 1 - 1/3 = 2/3; n3, n4 -1/3.
    got = adv.grpo([hand_tree()], norm_by_std=False)
    assert got == pytest.approx({("a", 2): 2 / 3, ("a", 3): -1 / 3, ("a", 4): -1 / 3}, abs=ATOL)


def test_treepo_by_hand():
    # n2: groups root {1,0,0} -> 1.154700 and n1 {1,0} -> 0.707107; mean 0.930904.
    # n3: root -0.577350 and n1 -0.707107; mean -0.642229.
    # n4: only the root (its parent) -> -0.577350.
    got = adv.treepo([hand_tree()])
    assert got[("a", 2)] == pytest.approx(0.930904, rel=1e-5, abs=1e-5)
    assert got[("a", 3)] == pytest.approx(-0.642229, rel=1e-5, abs=1e-5)
    assert got[("a", 4)] == pytest.approx(-0.577350, rel=1e-5, abs=1e-5)


def test_single_leaf_tree_group_of_one():
    # One leaf with reward 1: every kind's prompt group is a group of one -> 1/(1+eps).
    t = RolloutTree.new("s", "q", ["a"], prompt_ids=[1])
    t.add_child(0, rollout=0, **turn([2], [1], reward=1.0))
    t.compute_values()
    assert adv.grpo([t])[("s", 1)] == pytest.approx(1.0, abs=1e-5)
    assert adv.treepo([t])[("s", 1)] == pytest.approx(1.0, abs=1e-5)
    assert adv.tree_grpo([t])[("s", 1)] == pytest.approx(2.0, abs=1e-5)  # prompt + subtree


def test_segment_by_hand():
    # Values: V(root) = 1/3, V(n1) = 1/2.
    # n2 sequence [1, 2 | 3, 4, 5 | 6, 7]: turn n1 (anchor root) 1 - 1/3 = 2/3 on 3, 4 (5 is an
    # observation -> 0); turn n2 (anchor n1) 1 - 1/2 = 1/2 on 6, 7; prompt tokens 0.
    # n3 [1, 2 | 3, 4, 5 | 8]: 0 - 1/3 on 3, 4; 0 - 1/2 on 8.
    # n4 [1, 2 | 9, 10]: 0 - 1/3 on 9, 10.
    got = adv.segment([hand_tree()])
    np.testing.assert_allclose(got[("a", 2)], [0, 0, 2 / 3, 2 / 3, 0, 0.5, 0.5],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[("a", 3)], [0, 0, -1 / 3, -1 / 3, 0, -0.5], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[("a", 4)], [0, 0, -1 / 3, -1 / 3], rtol=RTOL, atol=ATOL)


def test_branch_grpo_by_hand():
    # hand_tree, rewards {n2: 1, n3: 0, n4: 0}. Turn n1 (parent root, 3 leaves): the prompt
    # group, PROMPT (+1.154700 in n2's sequence, -0.577350 in n3's). Turns n2, n3 (parent n1,
    # 2 leaves): the branch {1, 0}, SUB (+-0.707107). Turn n4 (parent root): PROMPT[4].
    # n2 [1, 2 | 3, 4, 5 | 6, 7]; n3 [1, 2 | 3, 4, 5 | 8]; n4 [1, 2 | 9, 10].
    got = adv.branch_grpo([hand_tree()])
    np.testing.assert_allclose(got[("a", 2)], [0, 0, PROMPT[2], PROMPT[2], 0, SUB[2], SUB[2]],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[("a", 3)], [0, 0, PROMPT[3], PROMPT[3], 0, SUB[3]],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[("a", 4)], [0, 0, PROMPT[4], PROMPT[4]], rtol=RTOL, atol=ATOL)
    # Centred only: prompt 1 - 1/3 = 2/3 and -1/3; branch 1 - 1/2 = +-1/2.
    got = adv.branch_grpo([hand_tree()], norm_by_std=False)
    np.testing.assert_allclose(got[("a", 2)], [0, 0, 2 / 3, 2 / 3, 0, 0.5, 0.5], atol=ATOL)
    np.testing.assert_allclose(got[("a", 3)], [0, 0, -1 / 3, -1 / 3, 0, -0.5], atol=ATOL)


def test_branch_grpo_falls_back_past_one_leaf_prefixes():
    """A turn below a one-leaf prefix takes the next branch point up::

        root [1]
        |- n1 rollout 0: [2]
        |   |- n2: [3]
        |   |   |- n3 leaf: [4]  reward 1
        |   |- n4 leaf: [5]      reward 1   (a continuation from n1)
        |- n5 rollout 1: [6]
            |- n6 leaf: [7]      reward 0
    Prompt {1, 1, 0}: mean 2/3, std sqrt(1/3): 1 -> (1/3)/0.577350 = 0.577350, 0 -> -1.154700.
    n3's turns: n1 (parent root) 0.577350; n2 (parent n1, leaves {1, 1}) 0; n3 (parent n2, one
    leaf, so n1's group) 0 -- segment would give it 1 - V(n2) = 0 too, but by another rule.
    n6's turns: n5 (root) -1.154700; n6 (parent n5, one leaf: the root's group) -1.154700,
    where segment gives 0 - V(n5) = 0.
    """
    t = RolloutTree.new("f", "q", ["a"], prompt_ids=[1])
    t.add_child(0, rollout=0, **turn([2], [1]))
    t.add_child(1, **turn([3], [1]))
    t.add_child(2, **turn([4], [1], reward=1.0))
    t.add_child(1, **turn([5], [1], reward=1.0))
    t.add_child(0, rollout=1, **turn([6], [1]))
    t.add_child(5, **turn([7], [1], reward=0.0))
    t.compute_values()
    up, down = (1 / 3) / (math.sqrt(1 / 3) + E), (-2 / 3) / (math.sqrt(1 / 3) + E)
    got = adv.branch_grpo([t])
    np.testing.assert_allclose(got[("f", 3)], [0, up, 0, 0], atol=ATOL)
    np.testing.assert_allclose(got[("f", 4)], [0, up, 0], atol=ATOL)
    np.testing.assert_allclose(got[("f", 6)], [0, down, down], rtol=RTOL, atol=ATOL)
    assert adv.segment([t])[("f", 6)] == pytest.approx([0, -2 / 3, 0], abs=ATOL)


def test_branch_grpo_is_grpo_on_unbranched_trees():
    # Bare rollouts of 1-3 turns, never branched: every turn's group is the prompt's.
    rng = random.Random(1)
    trees = []
    for k in range(5):
        t = RolloutTree.new(f"u{k}", "q", ["a"], prompt_ids=[1, 2])
        for r in range(rng.randint(1, 5)):
            parent = 0
            depth = rng.randint(1, 3)
            for d in range(depth):
                leaf = d == depth - 1
                node = t.add_child(parent, **(dict(rollout=r) if parent == 0 else {}),
                                   **turn([3, 4, 5], [1, 1, int(leaf)],
                                          reward=float(rng.random() < 0.4) if leaf else None))
                parent = node.id
        t.compute_values()
        trees.append(t)
    for norm_by_std in (True, False):
        a = adv.branch_grpo(trees, norm_by_std)
        b = adv.token_advantages(trees, "grpo", norm_by_std)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-12)


def test_assign_advantages_per_token():
    t = hand_tree()
    seqs = t.flatten()
    per_token = adv.assign_advantages(seqs, [t], kind="tree_grpo")
    for s, a in zip(seqs, per_token):
        assert len(a) == len(s.input_ids)
        assert s.advantage == pytest.approx(PROMPT[s.leaf_id] + SUB[s.leaf_id], rel=RTOL, abs=ATOL)
        np.testing.assert_allclose(a, [s.advantage * m for m in s.policy_mask],
                                   rtol=RTOL, atol=ATOL)
    # Segment: seq.advantage is the mean over policy tokens; n2: (2/3 + 2/3 + 1/2 + 1/2)/4.
    per_token = adv.assign_advantages(seqs, [t], kind="segment")
    assert seqs[0].leaf_id == 2
    assert seqs[0].advantage == pytest.approx((4 / 3 + 1) / 4, rel=RTOL, abs=ATOL)
    assert per_token[0][4] == 0.0  # observation token


def test_errors_name_the_fix():
    t = hand_tree()
    with pytest.raises(ValueError, match="expected one of"):
        adv.token_advantages([t], kind="ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="appears twice"):
        adv.grpo([t, hand_tree()])
    stale = hand_tree()
    stale.add_child(1, **turn([11], [1], reward=1.0))
    with pytest.raises(ValueError, match="compute_values"):
        adv.tree_grpo([stale])


def random_trees(rng: random.Random, n_trees: int) -> list[RolloutTree]:
    trees = []
    for k in range(n_trees):
        t = RolloutTree.new(f"t{k}", "q", ["a"], prompt_ids=[1, 2, 3])
        for r in range(rng.randint(1, 4)):  # bare rollouts: chains of 1..4 turns
            parent, depth = 0, rng.randint(1, 4)
            for d in range(depth):
                n = rng.randint(1, 5)
                leaf = d == depth - 1
                kw = dict(rollout=r) if parent == 0 else {}
                reward = rng.choice([0.0, 1.0]) if leaf else None
                node = t.add_child(parent, **kw,
                                   **turn(range(n), [1] * (n - 1) + [int(leaf)], reward=reward))
                parent = node.id
        for _ in range(rng.randint(0, 5)):  # continuations from random inner prefixes
            prefixes = t.prefixes()
            if not prefixes:
                break
            parent = rng.choice(prefixes).id
            for d in range(rng.randint(1, 3)):
                leaf = d == 2 or rng.random() < 0.5
                n = rng.randint(1, 5)
                node = t.add_child(parent, **turn(range(n), [1] * n,
                                                  reward=rng.random() if leaf else None))
                parent = node.id
                if leaf:
                    break
            if not t.nodes[parent].finished:
                t.nodes[parent].finished, t.nodes[parent].reward = True, 0.0
        t.compute_values()
        trees.append(t)
    return trees


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_loop_matches_vectorised(norm_by_std):
    rng = random.Random(0)
    for _ in range(20):
        trees = random_trees(rng, rng.randint(1, 6))
        for fast, slow in [(adv.grpo, references.grpo_loop),
                           (adv.tree_grpo, references.tree_grpo_loop),
                           (adv.treepo, references.treepo_loop)]:
            a, b = fast(trees, norm_by_std), slow(trees, norm_by_std)
            assert a.keys() == b.keys()
            np.testing.assert_allclose([a[k] for k in a], [b[k] for k in a], rtol=1e-9, atol=1e-9)
        for a, b in [(adv.segment(trees), references.segment_loop(trees)),
                     (adv.branch_grpo(trees, norm_by_std),
                      references.branch_grpo_loop(trees, norm_by_std))]:
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_allclose(a[k], b[k], rtol=1e-9, atol=1e-9)
        # Per-token lists align with the flattened sequences.
        seqs = [s for t in trees for s in t.flatten()]
        for s, row in zip(seqs, adv.assign_advantages(seqs, trees, "treepo")):
            assert len(row) == len(s.input_ids)
            assert all(x == 0.0 for x, m in zip(row, s.policy_mask) if not m)


def test_normalize_groups_matches_numpy():
    rng = np.random.default_rng(0)
    r = rng.random(50)  # (50,)
    g = rng.integers(0, 7, size=50)  # (50,)
    out = adv.normalize_groups(r, g)
    for k in np.unique(g):
        sel = g == k
        if sel.sum() == 1:
            expected = r[sel] / (1 + adv.EPS)
        else:
            expected = (r[sel] - r[sel].mean()) / (r[sel].std(ddof=1) + adv.EPS)
        np.testing.assert_allclose(out[sel], expected, rtol=1e-9, atol=1e-9)
