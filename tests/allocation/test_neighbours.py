"""RootNeighbours: hand-checked posteriors, the brute-force reference of the fast path, the
prompt's own rows left out, the memory's bounds and state round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trace_lightning.allocation.neighbours import RootNeighbours, neighbour_posterior, root_rows
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
    one = neighbour_posterior(x, MEMORY, S, N, none, prior, k=1, strength=2.0)
    assert one.item() == pytest.approx((2 * 0.5 + 3) / (2 + 4))  # row 0: 4 / 6
    two = neighbour_posterior(x, MEMORY, S, N, none, prior, k=2, strength=2.0)
    assert two.item() == pytest.approx((1 + 3 + 1) / (2 + 4 + 2))  # rows 0 and 2: 5 / 8
    # row 0 is the query's own prompt: the nearest other is row 2
    own = torch.tensor([[True, False, False, False]])
    assert neighbour_posterior(x, MEMORY, S, N, own, prior, k=1, strength=2.0).item() == \
        pytest.approx((1 + 1) / (2 + 2))
    # more neighbours asked than other rows: only the other rows count
    assert neighbour_posterior(x, MEMORY, S, N, own, prior, k=9, strength=2.0).item() == \
        pytest.approx((1 + 0 + 1 + 2) / (2 + 4 + 2 + 4))


def test_posterior_matches_a_brute_force_reference():
    rng = np.random.default_rng(0)
    memory = rng.normal(size=(50, 6)) * rng.uniform(0.1, 10, size=6) + rng.normal(size=6)
    x = rng.normal(size=(7, 6)) * 3
    s, n = rng.integers(0, 5, 50).astype(float), np.full(50, 4.0)
    same = rng.random((7, 50)) < 0.1
    prior = rng.uniform(size=7)
    got = neighbour_posterior(*(torch.tensor(a, dtype=torch.float64) for a in (x, memory, s, n)),
                              torch.tensor(same), torch.tensor(prior), k=5, strength=3.0)
    mu, sd = memory.mean(0), memory.std(0)
    z = (memory - mu) / sd
    for q in range(7):
        zq = (x[q] - mu) / sd
        cos = [float(zq @ z[j] / np.linalg.norm(zq) / np.linalg.norm(z[j])) for j in range(50)]
        near = sorted((j for j in range(50) if not same[q, j]), key=lambda j: -cos[j])[:5]
        want = (3.0 * prior[q] + s[near].sum()) / (3.0 + n[near].sum())
        assert got[q].item() == pytest.approx(want, abs=1e-9)


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
