"""RootNeighbours: hand-checked posteriors and belief counts, the brute-force reference of
the fast path, the prompt's own rows left out, the history after it, the memory's bounds and
state round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_lightning.allocation.neighbours import (MAX_COUNT, RootNeighbours, neighbour_posterior,
                                                   root_rows)
from trace_lightning.tree import RolloutTree

from builders.trees import tree_with_continuations

KW = dict(token_ids=[7], logprobs=[-1.0], policy_mask=[1])

# four memory rows on the axes: mean 0 and the same spread in both dimensions, so the
# standardisation leaves every cosine as it is
MEMORY = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])  # (4, 2)
S = torch.tensor([3.0, 0.0, 1.0, 2.0])  # successes per row
N = torch.tensor([4.0, 4.0, 2.0, 4.0])  # bare rollouts per row


def test_posterior_by_hand():
    # the query (2, 0.1): cosines 0.999 (row 0), 0.05 (row 2), -0.05 (row 3), -0.999 (row 1)
    x, prior, none = torch.tensor([[2.0, 0.1]]), torch.tensor([0.5]), torch.zeros(1, 4, dtype=bool)

    def v(same, k):
        return neighbour_posterior(x, MEMORY, S, N, same, prior, k=k, strength=2.0)[0].item()
    assert v(none, 1) == pytest.approx((2 * 0.5 + 3) / (2 + 4))  # row 0: 4 / 6
    assert v(none, 2) == pytest.approx((1 + 3 + 1) / (2 + 4 + 2))  # rows 0 and 2: 5 / 8
    # row 0 is the query's own prompt: the nearest other is row 2
    own = torch.tensor([[True, False, False, False]])
    assert v(own, 1) == pytest.approx((1 + 1) / (2 + 2))
    # more neighbours asked than other rows: only the other rows count
    assert v(own, 9) == pytest.approx((1 + 0 + 1 + 2) / (2 + 4 + 2 + 4))


def test_belief_count_by_hand():
    """Two neighbours of 4 rollouts each. One always failed, one always succeeded: rate 1/2,
    weighted variance of the rates 1/4, binomial part 1/2 * 1/2 * 2 / 8 = 1/16, so s2 = 3/16
    and with v = (2 * 0.5 + 4) / (2 + 8) = 1/2, c = (1/4) / (3/16) - 1 = 1/3. Two at 2 of 4:
    no spread beyond the binomial noise, the largest count."""
    memory = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    s, n = torch.tensor([0.0, 4.0, 2.0, 2.0]), torch.full((4,), 4.0)
    x = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])  # nearest: rows 0 and 1; rows 2 and 3
    v, c = neighbour_posterior(x, memory, s, n, torch.zeros(2, 4, dtype=bool),
                               torch.tensor([0.5, 0.5]), k=2, strength=2.0)
    assert v.tolist() == pytest.approx([0.5, 0.5])
    assert c.tolist() == pytest.approx([1 / 3, MAX_COUNT])


def test_posterior_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    memory = rng.normal(size=(50, 6)) * rng.uniform(0.1, 10, size=6) + rng.normal(size=6)
    x = rng.normal(size=(7, 6)) * 3
    s, n = rng.integers(0, 5, 50).astype(float), rng.integers(1, 5, 50).astype(float)
    s = np.minimum(s, n)
    same = rng.random((7, 50)) < 0.1
    prior = rng.uniform(size=7)
    v, c = neighbour_posterior(*(torch.tensor(a, dtype=torch.float64) for a in (x, memory, s, n)),
                               torch.tensor(same), torch.tensor(prior), k=5, strength=3.0)
    mu, sd = memory.mean(0), memory.std(0)
    z = (memory - mu) / sd
    for q in range(7):
        zq = (x[q] - mu) / sd
        cos = [float(zq @ z[j] / np.linalg.norm(zq) / np.linalg.norm(z[j])) for j in range(50)]
        near = sorted((j for j in range(50) if not same[q, j]), key=lambda j: -cos[j])[:5]
        want = (3.0 * prior[q] + s[near].sum()) / (3.0 + n[near].sum())
        assert v[q].item() == pytest.approx(want, abs=1e-9)
        rate = s[near].sum() / n[near].sum()
        spread = np.average((s[near] / n[near] - rate) ** 2, weights=n[near])
        s2 = max(spread - rate * (1 - rate) * 5 / n[near].sum(), 1e-9)
        assert c[q].item() == pytest.approx(min(max(want * (1 - want) / s2 - 1, 0.05), MAX_COUNT))


def test_root_rows_count_bare_rollouts_only():
    t = tree_with_continuations("q1")  # bare outcomes 0, 1, 0; continuations left out
    feats = {("q1", 0): torch.tensor([1.0, 2.0])}
    (pid, x, s, n), = root_rows([t, RolloutTree.new("bare", "q?", ["x"], [1])], feats)
    assert (pid, x.tolist(), s, n) == ("q1", [1.0, 2.0], 1.0, 3.0)


def test_adjust_moves_roots_only_and_never_reads_the_prompts_own_rows():
    nb = RootNeighbours(k=1, strength=2.0, capacity=4)
    nb.record([(f"m{j}", MEMORY[j], float(S[j]), float(N[j])) for j in range(4)])
    trees = [RolloutTree.new(i, "q?", ["x"], [1]) for i in ("new", "m0", "nofeat")]
    for t in trees:
        t.root.prediction = 0.5
    prefix = trees[0].add_child(0, rollout=0, **KW)
    prefix.prediction = 0.3
    feats = {("new", 0): torch.tensor([2.0, 0.1]), ("m0", 0): torch.tensor([2.0, 0.1]),
             ("new", prefix.id): torch.tensor([0.0, 1.0])}
    nb.adjust(trees, feats)
    assert trees[0].root.prediction == pytest.approx(4 / 6)  # row 0, as by hand
    assert trees[0].root.prediction_count == MAX_COUNT  # one neighbour: no spread
    assert trees[1].root.prediction == pytest.approx(2 / 4)  # its own row 0 left: row 2
    assert trees[2].root.prediction == 0.5  # no features: left
    assert prefix.prediction == 0.3


def test_memory_keeps_the_newest_rows_and_round_trips():
    nb = RootNeighbours(k=1, strength=1.0, capacity=3)
    assert len(nb) == 0
    tree = RolloutTree.new("q", "q?", ["x"], [1])
    tree.root.prediction = 0.25
    nb.adjust([tree], {("q", 0): torch.ones(2)})  # empty memory: left
    assert tree.root.prediction == 0.25
    nb.record([(f"p{j}", torch.full((2,), float(j)), 1.0, 2.0) for j in range(5)])
    assert nb.ids == ["p2", "p3", "p4"] and nb.features[:, 0].tolist() == [2.0, 3.0, 4.0]
    again = RootNeighbours(k=1, strength=1.0, capacity=2)
    again.load_state_dict(nb.state_dict())
    assert again.ids == ["p3", "p4"] and again.s.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="width 3 against the memory's 2"):
        nb.record([("w", torch.ones(3), 1.0, 1.0)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), r"--model.neighbours.k \(0\) must be a whole number >= 1"),
    (dict(strength=0.0), r"--model.neighbours.strength \(0.0\) must be a finite number > 0"),
    (dict(k=5, capacity=4), r"--model.neighbours.capacity \(4\) must be a whole number >= k"),
])
def test_bad_settings_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RootNeighbours(**kwargs)


def test_history_after_neighbours_keeps_their_count_where_it_has_no_evidence():
    from trace_lightning.allocation.history import PromptHistory

    def root(tree_id):
        t = RolloutTree.new(tree_id, "q?", ["x"], [1])
        t.root.prediction, t.root.prediction_count = 0.4, 0.5  # as RootNeighbours leaves it
        return t
    for belief in (True, False):
        h = PromptHistory(strength=2.0, decay=1.0, belief=belief)
        h.record([("seen", 0, 1.0, 3.0)])
        new, seen = root("new"), root("seen")
        h.adjust([new, seen], step=1)
        assert new.root.prediction == 0.4 and seen.root.prediction == pytest.approx(1.8 / 5)
        # belief: the neighbours' count stands in for strength; else exact once seen
        assert new.root.prediction_count == 0.5
        assert seen.root.prediction_count == (pytest.approx(3.5) if belief else None)
