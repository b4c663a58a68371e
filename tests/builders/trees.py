"""Rollout trees and leaf sequences built by hand, shared by the tests of packing, training,
allocation and the training step's statistics."""

from __future__ import annotations

import random

from trace_lightning.tree import LeafSequence, RolloutTree

HAND_VOCAB = 61  # hand_trees' token ids are below it: the vocabulary of the policy run on them
TINY_VOCAB = 97  # random_leaf's: the training tests' tiny policy (the ``policy_dir`` fixture)


def _turn(rng: random.Random, policy: int, obs: int, **fields) -> dict:
    """A turn of ``policy`` generated tokens then ``obs`` observation tokens."""
    ids = [rng.randrange(3, HAND_VOCAB) for _ in range(policy + obs)]
    return dict(token_ids=ids, policy_mask=[1] * policy + [0] * obs,
                logprobs=[-3.0 + rng.gauss(0, 0.5) for _ in range(policy)] + [0.0] * obs,
                **fields)


def _leaf(rng, policy: int, reward: float) -> dict:
    return _turn(rng, policy, 0, finished=True, reward=reward)


def hand_trees(seed: int = 0) -> list[RolloutTree]:
    """Three trees:

    ``a``: rollout 0 is three turns (root - t1 - t2 - leaf); continuations branch from t1 (one
    ending at once) and from t2 (one going on for two turns, one ending); rollout 1 is one
    turn. Leaves 6, with rewards mixed at every depth.
    ``b``: one leaf (a single-leaf tree).
    ``c``: two bare rollouts of two turns, both successes.
    """
    rng = random.Random(seed)
    a = RolloutTree.new("a", "q", ["x"], [1, 2, 3, 4, 5])
    t1 = a.add_child(0, rollout=0, **_turn(rng, 3, 2))
    t2 = a.add_child(t1.id, **_turn(rng, 2, 3))
    a.add_child(t2.id, **_leaf(rng, 3, 1.0))
    a.add_child(t1.id, **_leaf(rng, 2, 0.0))  # a continuation that ends at once
    t3 = a.add_child(t2.id, **_turn(rng, 2, 1))
    a.add_child(t3.id, **_leaf(rng, 2, 0.0))
    a.add_child(t2.id, **_leaf(rng, 4, 1.0))
    a.add_child(0, rollout=1, **_leaf(rng, 4, 0.0))
    b = RolloutTree.new("b", "q", ["x"], [2, 7, 9])
    b.add_child(0, rollout=0, **_leaf(rng, 5, 1.0))
    c = RolloutTree.new("c", "q", ["x"], [6, 2])
    for j in range(2):
        u = c.add_child(0, rollout=j, **_turn(rng, 2, 2))
        c.add_child(u.id, **_leaf(rng, 3, 1.0))
    for t in (a, b, c):
        t.compute_values()
    return [a, b, c]


def random_leaf(rng: random.Random, n: int, k: int, idx: int,
                vocab: int = TINY_VOCAB) -> LeafSequence:
    """``n`` tokens, the first ``k`` prompt tokens, then policy and observation spans."""
    mask = [0] * k + [int(i % 5 != 4) for i in range(n - k)]
    ids = [rng.randrange(1, vocab) for _ in range(n)]
    logprobs = [-4.6 + rng.gauss(0, 0.3) if m else 0.0 for m in mask]
    reward = float(idx % 2)
    return LeafSequence(tree_id=f"t{idx}", leaf_id=idx, rollout=0, input_ids=ids,
                        policy_mask=mask, logprobs=logprobs, reward=reward, ancestors=[0],
                        advantage=1.0 if reward else -1.0)


def mixed_trees() -> list[RolloutTree]:
    """Six two-turn trees of two rollouts, one success and one failure each."""
    out = []
    for k in range(6):
        t = RolloutTree.new(f"q{k}", "q", ["a"], [1, 2, 3 + k])
        for j in range(2):
            a = t.add_child(0, rollout=j, token_ids=[5, 6, 7], logprobs=[-1.0, -1.0, 0.0],
                            policy_mask=[1, 1, 0])
            t.add_child(a.id, token_ids=[8, 9], logprobs=[-1.0, -1.0], policy_mask=[1, 1],
                        finished=True, reward=float((j + k) % 2))
        t.compute_values()
        out.append(t)
    return out


def chain_tree(tree_id: str, rewards: list[float], turns: int | list[int] = 1,
               root_p: float | None = None, prefix_p: float | None = None,
               question: str = "q") -> RolloutTree:
    """One bare chain per reward, of ``turns`` turns (one count for all, or one per reward),
    each turn one policy token; non-leaf turns predicted ``prefix_p``, the root ``root_p``."""
    t = RolloutTree.new(tree_id, question, ["a"], prompt_ids=[1, 2])
    t.root.prediction = root_p
    lengths = [turns] * len(rewards) if isinstance(turns, int) else turns
    for j, (r, n) in enumerate(zip(rewards, lengths, strict=True)):
        parent = 0
        for d in range(n):
            last = d == n - 1
            node = t.add_child(parent, rollout=j if parent == 0 else None, token_ids=[3],
                               logprobs=[-0.1], policy_mask=[1], finished=last,
                               reward=r if last else None, prediction=None if last else prefix_p)
            parent = node.id
    return t


_KW = dict(token_ids=[7], logprobs=[-1.0], policy_mask=[1])


def tree_with_continuations(tree_id: str = "q1") -> RolloutTree:
    """Two bare rollouts, then continuations added as stage 2 would (later children)::

        root ─ a (rollout 0) ─ a1 leaf r=0      <- bare path of rollout 0
               │              └ a2 leaf r=1      (continuation from a)
               └ b (rollout 1) ─ b1 leaf r=1    <- bare path of rollout 1
                                 └ b2 leaf r=1   (continuation from b)
               └ c (rollout 2) leaf r=0          (an extra bare rollout: single turn)
    """
    t = RolloutTree.new(tree_id, "q?", ["x"], [1, 2])
    a = t.add_child(0, rollout=0, **_KW)
    b = t.add_child(0, rollout=1, **_KW)
    t.add_child(a.id, finished=True, reward=0.0, **_KW)
    t.add_child(b.id, finished=True, reward=1.0, **_KW)
    t.add_child(a.id, finished=True, reward=1.0, **_KW)  # continuation
    t.add_child(b.id, finished=True, reward=1.0, **_KW)  # continuation
    t.add_child(0, rollout=2, finished=True, reward=0.0, **_KW)
    return t
