"""The TRACE solvers: exact against brute force, hand-derived instances, edge cases."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from references import spread_prefix_budget
from trace_lightning.math.solvers import (
    draw_random,
    beta_moment,
    expected_root_values,
    prefix_gain,
    prefix_value,
    repeat_prob,
    root_gain,
    root_value,
    solve_prefixes,
    solve_root_values,
    solve_roots,
    spendable_roots,
)

# ---- brute force (tests only) -------------------------------------------------------------


def brute_force_roots(v, budget, m_max, max_prompts=None):
    """Best value over all m in {0, 2..m_max}^n with at most max_prompts opened.

    Returns (max spendable total <= budget, best value at that total).
    """
    n = len(v)
    k_cap = n if max_prompts is None else max_prompts
    feasible = []
    for m in itertools.product([0, *range(2, m_max + 1)], repeat=n):
        if sum(m) <= budget and sum(x > 0 for x in m) <= k_cap:
            feasible.append(m)
    spend = max(sum(m) for m in feasible)
    best = max(sum(root_value(x, k) for x, k in zip(v, m)) for m in feasible if sum(m) == spend)
    return spend, best


def brute_force_prefixes(q, budget, cap=None):
    """Best ``sum 1 - q^c`` over all c with c_k <= cap and sum c = min(budget, n cap)."""
    n = len(q)
    hi = budget if cap is None else min(cap, budget)
    spend = budget if cap is None else min(budget, n * cap)
    best = -1.0
    for c in itertools.product(range(hi + 1), repeat=n):
        if sum(c) == spend:
            best = max(best, sum(prefix_value(qk, ck) for qk, ck in zip(q, c)))
    return spend, best


def roots_objective(v, m):
    return sum(root_value(x, k) for x, k in zip(v, m))


def random_prob(rng: random.Random) -> float:
    """Mostly uniform, sometimes a grid value (ties) or an edge (0, 1, 0.5)."""
    u = rng.random()
    if u < 0.15:
        return rng.choice([0.0, 1.0, 0.5])
    if u < 0.35:
        return rng.choice([0.1, 0.3, 0.7, 0.9])
    return rng.random()


# ---- values and gains --------------------------------------------------------------------


def test_values_and_gains_hand_derived():
    # V(0.5, 2) = 1 - 0.25 - 0.25 = 0.5; V(0.9, 2) = 1 - 0.81 - 0.01 = 0.18
    assert root_value(0.5, 2) == pytest.approx(0.5, rel=1e-12)
    assert root_value(0.9, 2) == pytest.approx(0.18, rel=1e-12)
    # m = 0 and m = 1 are worth nothing (the formula would give -1 at m = 0)
    assert root_value(0.5, 0) == 0.0 and root_value(0.5, 1) == 0.0
    # 3rd rollout at v = 0.5: 0.5^2 * 0.5 + 0.5^2 * 0.5 = 0.25 = V(0.5,3) - V(0.5,2) = 0.75 - 0.5
    assert root_gain(0.5, 2) == pytest.approx(0.25, rel=1e-12)
    assert root_value(0.5, 3) - root_value(0.5, 2) == pytest.approx(0.25, rel=1e-12)
    for v in [0.0, 0.13, 0.5, 0.77, 1.0]:
        for m in range(1, 8):
            assert root_gain(v, m) == pytest.approx(root_value(v, m + 1) - root_value(v, m),
                                                    abs=1e-12)
    # q for a failure (r=0) with p=0.9 is 0.1; for a success (r=1) with p=0.9 it is 0.9
    assert repeat_prob(0.0, 0.9) == pytest.approx(0.1, rel=1e-12)
    assert repeat_prob(1.0, 0.9) == pytest.approx(0.9, rel=1e-12)
    # 1 - 0.1^2 = 0.99; gain of the 2nd continuation = 0.1 * 0.9 = 0.09
    assert prefix_value(0.1, 2) == pytest.approx(0.99, rel=1e-12)
    assert prefix_gain(0.1, 1) == pytest.approx(0.09, rel=1e-12)


# ---- stage 1: roots ----------------------------------------------------------------------


def test_roots_hand_derived():
    # v = [0.5, 0.9, 0.0], budget 4, m_max 4.
    # Options at total 4: (4,0,0) = V(.5,4) = 1 - 2/16 = 0.875; (2,2,0) = 0.5 + 0.18 = 0.68;
    # (2,0,2) = 0.5 + 0 = 0.5; (0,4,0) = 1 - .6561 - .0001 = 0.3438; (0,2,2) = 0.18.
    # (3, *, *) would leave 1 unit no other prompt can take (an opened prompt needs 2).
    # Best: (4, 0, 0).
    assert solve_roots([0.5, 0.9, 0.0], 4, 4) == [4, 0, 0]
    # With m_max = 2: (2,2,0) = 0.68 beats (2,0,2) = 0.5.
    assert solve_roots([0.5, 0.9, 0.0], 4, 2) == [2, 2, 0]


def test_roots_naive_heap_is_not_exact():
    # v = [0.5, 0.14], budget 5. The per-unit heap opens 0.5 (0.25/unit), extends it (0.25),
    # then takes its 4th rollout (gain 0.125) over opening 0.14 (0.14*0.86 = 0.1204/unit) and
    # must give the last unit to the 5th rollout: (5,0) = 1 - 2/32 = 0.9375.
    # Optimum: (3,2) = 0.75 + 2*0.1204 = 0.9908.
    m = solve_roots([0.5, 0.14], 5, 8)
    assert m == [3, 2]
    assert roots_objective([0.5, 0.14], m) == pytest.approx(0.75 + 2 * 0.14 * 0.86, rel=1e-12)


def test_roots_match_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 4)
        v = [random_prob(rng) for _ in range(n)]
        budget = rng.randint(0, 10)
        m_max = rng.randint(2, 5)
        max_prompts = None if trial % 2 else rng.randint(0, n)
        m = solve_roots(v, budget, m_max, max_prompts)
        spend, best = brute_force_roots(v, budget, m_max, max_prompts)
        info = (v, budget, m_max, max_prompts, m)
        assert len(m) == n, info
        assert all(x == 0 or 2 <= x <= m_max for x in m), info
        assert max_prompts is None or sum(x > 0 for x in m) <= max_prompts, info
        assert sum(m) == spend == spendable_roots(budget, n, m_max, max_prompts), info
        np.testing.assert_allclose(roots_objective(v, m), best, rtol=1e-9, atol=1e-12,
                                   err_msg=str(info))


def test_roots_spend_the_whole_budget_at_scale():
    rng = np.random.default_rng(1)
    v = rng.random(500).tolist()
    for budget, m_max, k in [(512, 16, None), (512, 16, 40), (1536, 8, None), (99, 2, None)]:
        m = solve_roots(v, budget, m_max, k)
        assert sum(m) == spendable_roots(budget, 500, m_max, k)
    assert sum(solve_roots(v, 99, 2)) == 98  # m_max 2: odd totals leave one unit


def test_roots_edge_cases():
    assert solve_roots([], 10, 4) == []
    assert solve_roots([0.5, 0.5], 0, 4) == [0, 0]
    assert solve_roots([0.5, 0.5], 1, 4) == [0, 0]  # one rollout cannot open a prompt
    assert solve_roots([0.5, 0.5], 3, 4) == [3, 0]  # 3 rollouts on one beat nothing else
    assert solve_roots([0.5, 0.5], 5, 2) == [2, 2]  # m_max 2: odd leftover unit unspent
    assert solve_roots([0.5, 0.5], 20, 4) == [4, 4]  # more than n m_max: cap at n m_max
    assert solve_roots([0.5, 0.5, 0.5], 6, 4, max_prompts=1) == [4, 0, 0]
    assert solve_roots([0.5, 0.5], 4, 4, max_prompts=0) == [0, 0]
    # ties by index: equal prompts, the lower index gets the odd unit
    assert solve_roots([0.3, 0.7, 0.3], 7, 4) == [3, 2, 2]
    # all-zero value still spends the budget, spread over as many prompts as possible
    assert solve_roots([0.0, 1.0, 0.0, 1.0], 7, 4) == [3, 2, 2, 0]
    assert solve_roots([1.0] * 3, 12, 4) == [4, 4, 4]
    # zero-value prompts get budget only when valued ones are full
    # (0.5 at m_max 4 takes 4; the remaining 2 open a zero-value prompt)
    assert solve_roots([0.0, 0.5, 0.0], 6, 4) == [2, 4, 0]
    # a valued prompt beats zero-value ones even at its last useful rollout
    assert solve_roots([0.0, 0.02, 1.0], 4, 4) == [0, 4, 0]


def test_roots_reject_bad_input():
    with pytest.raises(ValueError, match=r"v\[1\] = 1.5"):
        solve_roots([0.5, 1.5], 4, 4)
    with pytest.raises(ValueError, match="not a probability"):
        solve_roots([float("nan")], 4, 4)
    with pytest.raises(ValueError, match="m_max"):
        solve_roots([0.5], 4, 1)
    with pytest.raises(ValueError, match="budget"):
        solve_roots([0.5], -1, 4)


# ---- stage 2: prefixes -------------------------------------------------------------------


def test_prefixes_hand_derived():
    # r = [0, 0, 1], p = [0.9, 0.1, 0.9] -> q = [0.1, 0.9, 0.9]
    # first-unit gains: 0.9, 0.1, 0.1; second unit of prefix 0: 0.1 * 0.9 = 0.09.
    # budget 3: 0.9 (prefix 0), 0.1 (prefix 1, lower index of the tie), 0.1 (prefix 2)
    assert solve_prefixes([0, 0, 1], [0.9, 0.1, 0.9], 3) == [1, 1, 1]
    # budget 4: the next best is 0.09 (prefix 0, 2nd) vs 0.09 (prefixes 1 and 2, 2nd: 0.9*0.1);
    # a tie in gain goes to fewer units so far (all have 1 after prefix 0's first), then index
    assert solve_prefixes([0, 0, 1], [0.9, 0.1, 0.9], 4) == [2, 1, 1]
    # budget 1: the failed rollout whose prefix looked likely to succeed
    assert solve_prefixes([0, 0], [0.2, 0.8], 1) == [0, 1]


def test_prefixes_match_brute_force():
    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(1, 4)
        r = [rng.choice([0.0, 1.0, 0.5]) if rng.random() < 0.2 else float(rng.random() < 0.5)
             for _ in range(n)]
        p = [random_prob(rng) for _ in range(n)]
        budget = rng.randint(0, 8)
        cap = None if trial % 2 else rng.randint(1, 3)
        c = solve_prefixes(r, p, budget, cap)
        q = [repeat_prob(rk, pk) for rk, pk in zip(r, p)]
        spend, best = brute_force_prefixes(q, budget, cap)
        info = (r, p, budget, cap, c)
        assert sum(c) == spend, info
        assert cap is None or max(c) <= cap, info
        np.testing.assert_allclose(sum(prefix_value(qk, ck) for qk, ck in zip(q, c)), best,
                                   rtol=1e-9, atol=1e-12, err_msg=str(info))


def test_prefixes_edge_cases():
    assert solve_prefixes([], [], 5) == []  # no prefixes: all 5 left over
    assert solve_prefixes([1.0], [0.5], 0) == [0]
    # q = 1 everywhere (prediction equals the outcome): no gain, budget still spent round-robin
    assert solve_prefixes([1, 0, 1], [1.0, 0.0, 1.0], 7) == [3, 2, 2]
    # capped out: only 2 * 2 = 4 of 7 spent; the caller sees the leftover
    assert solve_prefixes([0, 1], [0.5, 0.5], 7, cap=2) == [2, 2]
    with pytest.raises(ValueError, match="one entry per prefix"):
        solve_prefixes([0, 1], [0.5], 2)
    with pytest.raises(ValueError, match="cap"):
        solve_prefixes([0], [0.5], 2, cap=0)


def test_spread_pools_unused_budget():
    # prompt 0: only single-turn rollouts (no prefixes), budget 4 -> all 4 returned to the pool
    # prompt 1: q = [0.1, 0.9], budget 2 -> [1, 1] (0.9, then 0.1 vs 0.09)
    # pool of 4 on prompt 1 from [1, 1]: gains 0.09 (k0, 2nd), 0.09 (k1, 2nd) -> both;
    # then 0.009 (k0, 3rd) vs 0.081 (k1, 3rd) -> k1; then 0.0729 (k1, 4th) -> k1: [2, 4]
    out = spread_prefix_budget([[], [(0.0, 0.9), (1.0, 0.9)]], [4, 2])
    assert out.counts == [[], [2, 4]]
    assert out.pool_returned == 4 and out.unspent == 0
    # caps: prompt 1 holds at most 2 * 2 = 4 of the 6
    out = spread_prefix_budget([[], [(0.0, 0.9), (1.0, 0.9)]], [4, 2], cap=2)
    assert out.counts == [[], [2, 2]]
    assert out.pool_returned == 4 and out.unspent == 2
    # nothing to branch from anywhere: everything returned and unspent
    out = spread_prefix_budget([[], []], [3, 3])
    assert out.counts == [[], []] and out.pool_returned == 6 and out.unspent == 6


def test_spread_conserves_budget_on_random_instances():
    rng = random.Random(2)
    for _ in range(100):
        prompts = [[(float(rng.random() < 0.5), rng.random()) for _ in range(rng.randint(0, 3))]
                   for _ in range(rng.randint(1, 4))]
        budgets = [rng.randint(0, 6) for _ in prompts]
        cap = rng.choice([None, 1, 2])
        out = spread_prefix_budget(prompts, budgets, cap)
        capacity = sum(len(p) for p in prompts) * (cap if cap else 10**9)
        assert sum(map(sum, out.counts)) == min(sum(budgets), capacity)
        assert sum(map(sum, out.counts)) + out.unspent == sum(budgets)
        # phase 1 is each prompt's own optimum: a prompt keeps at least min(budget, capacity)
        for p, b, c in zip(prompts, budgets, out.counts):
            assert sum(c) >= min(b, len(p) * (cap if cap else 10**9))


def test_draw_random_is_seeded_uniform_and_capped():
    """random_tree's draws (``PrefixPlanner`` gives each prompt its own generator)."""
    a, b = [0, 0, 0], [0, 0, 0]
    assert draw_random(a, 5, np.random.default_rng(7)) == 5 == sum(a)
    draw_random(b, 5, np.random.default_rng(7))
    assert a == b
    assert draw_random([], 4, np.random.default_rng(0)) == 0  # no prefix: all to the pool
    c = [0]
    assert draw_random(c, 5, np.random.default_rng(0), cap=2) == 2 and c == [2]
    # uniform over the prefixes: 40,000 units over 4, 10,000 +- 5 sigma each
    counts = [0] * 4
    draw_random(counts, 40_000, np.random.default_rng(1))
    sigma = (40_000 * 0.25 * 0.75) ** 0.5
    assert all(abs(k - 10_000) <= 5 * sigma for k in counts)
    other = [0] * 4
    draw_random(other, 40_000, np.random.default_rng(2))
    assert counts != other


# ---- stage 1 with uncertain predictions ----------------------------------------------------


def test_beta_moments_and_expected_values_hand_derived():
    # uniform belief Beta(1, 1): E[x^2] = 1 * 2 / (2 * 3) = 1/3, E[x^3] = 1/4
    assert beta_moment(1, 1, 2) == pytest.approx(1 / 3)
    assert beta_moment(1, 1, 3) == pytest.approx(1 / 4)
    assert beta_moment(0.0, 2.0, 3) == 0.0 and beta_moment(2.0, 0.0, 3) == 1.0  # point masses
    table = expected_root_values([0.5, 0.5, 0.35, 0.47, 0.0], [None, 1.0, 1.0, 5.0, 3.0], 3)
    # exact v = 0.5: 1 - 2 (1/4) = 0.5 at m = 2, 1 - 2 (1/8) = 0.75 at m = 3
    np.testing.assert_allclose(table[0], [0, 0, 0.5, 0.75])
    # v = 0.5 worth 1 rollout is Beta(0.5, 0.5): E[x^2] = 0.5 * 1.5 / (1 * 2) = 0.375,
    # so 1 - 2 (0.375) = 0.25; E[x^3] = 0.375 * 2.5 / 3 = 0.3125 -> 0.375
    np.testing.assert_allclose(table[1], [0, 0, 0.25, 0.375])
    # v = 0.35 worth 1: E[x^2] = 0.35 * 1.35 / 2 = 0.23625, E[(1-x)^2] = 0.65 * 1.65 / 2 =
    # 0.53625 -> 0.2275
    assert table[2, 2] == pytest.approx(0.2275)
    # v = 0.47 worth 5 (a prompt 2 of 4 right, prior 0.35 worth 1): a = 2.35, b = 2.65,
    # E[x^2] = 2.35 * 3.35 / 30, E[(1-x)^2] = 2.65 * 3.65 / 30 -> 1 - 0.26242 - 0.32242
    assert table[3, 2] == pytest.approx(1 - 2.35 * 3.35 / 30 - 2.65 * 3.65 / 30)
    np.testing.assert_allclose(table[4], 0.0)  # v = 0 is certain whatever its weight


def test_vague_predictions_lose_to_known_mixed_prompts():
    # 10 prompts never seen (0.35, worth 1 rollout) and 3 whose own rollouts were 2 of 4
    # right (0.47, worth 5): exact point predictions spread the budget almost evenly by v;
    # beliefs put it all on the 3 known-mixed prompts
    v, c = [0.35] * 10 + [0.47] * 3, [1.0] * 10 + [5.0] * 3
    assert solve_roots(v, 12, 8, counts=c) == [0] * 10 + [4, 4, 4]
    assert sum(solve_roots(v, 12, 8)[:10]) > 0
    # counts of None everywhere is the point solver
    assert solve_roots(v, 12, 8, counts=[None] * 13) == solve_roots(v, 12, 8)


def test_value_table_solver_matches_brute_force():
    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(1, 4)
        m_max = rng.randint(2, 5)
        v = [random_prob(rng) for _ in range(n)]
        counts = [None if rng.random() < 0.3 else rng.choice([0.5, 1.0, 3.0, 20.0])
                  for _ in range(n)]
        table = expected_root_values(v, counts, m_max)
        budget = rng.randint(0, 10)
        max_prompts = None if trial % 2 else rng.randint(0, n)
        m = solve_root_values(table, budget, max_prompts)
        spend = spendable_roots(budget, n, m_max, max_prompts)
        k_cap = n if max_prompts is None else max_prompts
        best = max(sum(table[i, x] for i, x in enumerate(mm))
                   for mm in itertools.product([0, *range(2, m_max + 1)], repeat=n)
                   if sum(mm) == spend and sum(x > 0 for x in mm) <= k_cap)
        info = (v, counts, budget, m_max, max_prompts, m)
        assert sum(m) == spend and all(x == 0 or 2 <= x <= m_max for x in m), info
        assert max_prompts is None or sum(x > 0 for x in m) <= max_prompts, info
        np.testing.assert_allclose(sum(table[i, x] for i, x in enumerate(m)), best,
                                   rtol=1e-9, atol=1e-12, err_msg=str(info))
        if all(c is None for c in counts):  # the two exact solvers agree on point values
            np.testing.assert_allclose(roots_objective(v, solve_roots(v, budget, m_max,
                                                                      max_prompts)), best,
                                       rtol=1e-9, atol=1e-12)


def test_a_prompt_cap_that_cannot_bind_costs_no_memory():
    """With exploration, plan_roots caps the prompts at the candidates not explored (506 of
    512 here), above the 232 that 464 rollouts can ever open (2 each): the solver must not
    keep a prompts-opened dimension for it. Its choice table would be 512 x 507 x 465 int16,
    241 MB (15 GB at 2,048 candidates); without it, 0.5 MB."""
    import tracemalloc

    rng = np.random.default_rng(0)
    v, counts = rng.random(512).tolist(), [3.0] * 512
    uncapped = solve_roots(v, 464, 16, counts=counts)
    tracemalloc.start()
    try:
        capped = solve_roots(v, 464, 16, max_prompts=506, counts=counts)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert capped == uncapped
    assert peak < 20e6, peak


def test_value_table_solver_at_scale_and_bad_counts():
    rng = np.random.default_rng(0)
    v = rng.random(512).tolist()
    m = solve_roots(v, 448, 8, counts=rng.uniform(1, 9, 512).tolist())  # the GPU config's size
    assert sum(m) == 448 and all(x == 0 or 2 <= x <= 8 for x in m)
    with pytest.raises(ValueError, match="counts"):
        expected_root_values([0.5], [0.0], 4)
    with pytest.raises(ValueError, match="counts"):
        expected_root_values([0.5, 0.5], [1.0], 4)
