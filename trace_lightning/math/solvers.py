"""TRACE budget allocation: the two exact solvers (roots, then prefixes), as pure functions.

Stage 1, roots. A prompt with predicted success ``v`` that gets ``m`` rollouts is worth the
probability that its leaves are mixed::

    V_root(v, m) = 1 - v^m - (1-v)^m          (m >= 1);  V_root(v, 0) = 0
    gain(v, m)   = V_root(v, m+1) - V_root(v, m) = v^m (1-v) + (1-v)^m v     (m >= 1)

``solve_roots`` maximises ``sum_i V_root(v_i, m_i)`` subject to ``sum_i m_i = S`` (the
budget, or the most of it that can be spent), ``m_i = 0`` or ``2 <= m_i <= m_max``, and at
most ``max_prompts`` prompts opened.

Deviation from the paper's / our design notes' "greedy max-heap over gains per unit (opening cost
2) is exact": it is not, because an opening block of 2 may not fit the last unit of budget.
Counterexample (a regression test): ``v = [0.5, 0.14]``, budget 5. The heap opens 0.5 (0.25
per unit), extends it (0.25), then prefers its 4th rollout (gain 0.125) to opening 0.14
(0.1204 per unit) and is left with one unit that only the 5th rollout can take:
``(5, 0)`` worth 0.9375, while ``(3, 2)`` is worth 0.75 + 0.2408 = 0.9908. The solver here is
exact instead, from two facts:

1. ``V_root(v, m)`` is, for every m, increasing in ``a = v (1-v)`` (``v^m + (1-v)^m`` is
   convex and symmetric around 1/2). Exchanging allocations therefore shows that some
   optimum opens exactly the k prompts with the largest ``a`` (ties by index) for some k.
2. Once opened (``m >= 2``), a prompt's gains ``a (v^(m-1) + (1-v)^(m-1))`` do not increase
   with m, so spending the other ``S - 2k`` units on the top ``S - 2k`` gains of those k
   prompts is exact.

So ``solve_roots`` tries every feasible k (``ceil(S/m_max) <= k <= min(n, max_prompts,
S/2)``) and keeps the best; cost ``O(k_range * k * m_max)`` numpy work, well under a second
for thousands of candidates.

Uncertain predictions. When a prediction comes with the number of rollouts ``c`` it is worth
(``PromptHistory``'s posteriors), the prompt's success is a belief ``Beta(v c, (1-v) c)`` and
the objective is the expected ``V_root`` under it (``expected_root_values``): a vague 0.5 is
worth less than a well-founded 0.5. Prompts then need not share one order of value for
every m, so ``solve_root_values`` solves that case exactly by dynamic programming instead.

Stage 2, prefixes. A prefix of a bare rollout with observed reward ``r`` and predicted
success ``p`` repeats the observed outcome with probability ``q = r p + (1-r)(1-p)``; ``c``
continuations from it flip the outcome at least once with probability ``1 - q^c``, marginal
gain ``q^c (1-q)``, non-increasing in c, so the greedy on marginal gain is exact
(``solve_prefixes``). ``allocators.PrefixPlanner`` runs it per prompt (phase 1) and then, with
``spend_pool`` (phase 2), spends whatever a prompt cannot use (no prefixes, or every prefix
capped) on the other prompts' prefixes; since gains are non-increasing per prefix, phase 2 is
the exact optimum given phase 1.

Ties in the greedy solvers (``solve_roots``, ``solve_prefixes``) are broken
deterministically: equal gains go to the item with fewer units so far, then to the lower
index, so zero-value items (``v`` or ``q`` in {0, 1}) share the budget round-robin instead of
piling onto the first one (``solve_root_values``, the dynamic programme for beliefs, keeps
the first optimum it finds). Gains are compared rounded to
``TIE_DECIMALS`` decimals, so mathematically equal ones tie despite rounding (``1 - 0.7`` is
not ``0.3`` in floats); this costs at most ``1e-12`` of objective per unit.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

TIE_DECIMALS = 12  # gains equal to this many decimals are ties (broken by count, then index)

# ---- values and marginal gains ------------------------------------------------------------


def root_value(v: float, m: int) -> float:
    """``V_root(v, m) = 1 - v^m - (1-v)^m`` for ``m >= 2``, and 0 for ``m in {0, 1}``."""
    if m < 2:
        return 0.0
    return 1.0 - v**m - (1.0 - v) ** m


def root_gain(v: float, m: int) -> float:
    """Gain of the (m+1)-th rollout: ``V_root(v, m+1) - V_root(v, m)``.

    ``v^m (1-v) + (1-v)^m v`` for ``m >= 1``; 0 for ``m = 0`` (one rollout is worth nothing).
    Opening a prompt (0 -> 2 rollouts) gains ``V_root(v, 2) = 2 v (1-v)``.
    """
    if m < 1:
        return 0.0
    return v**m * (1.0 - v) + (1.0 - v) ** m * v


def repeat_prob(r: float, p: float) -> float:
    """``q = r p + (1-r)(1-p)``: chance a continuation repeats the observed outcome ``r``."""
    return r * p + (1.0 - r) * (1.0 - p)


def prefix_value(q: float, c: int) -> float:
    """``V_pref(q, c) = 1 - q^c``: chance c continuations flip the outcome at least once."""
    return 1.0 - q**c


def prefix_gain(q: float, c: int) -> float:
    """Gain of the (c+1)-th continuation: ``q^c (1-q)``."""
    return q**c * (1.0 - q)


def _check_probs(name: str, xs: Sequence[float]) -> None:
    for i, x in enumerate(xs):
        if not (0.0 <= x <= 1.0):  # also rejects NaN
            raise ValueError(f"{name}[{i}] = {x} is not a probability in [0, 1]; clip the "
                             f"predictor's outputs (or rewards) to [0, 1] before allocating")


def _check_budget(budget: int) -> None:
    if budget < 0:
        raise ValueError(f"budget ({budget}) must be >= 0")


# ---- stage 1: roots ----------------------------------------------------------------------


def spendable_roots(budget: int, n: int, m_max: int, max_prompts: int | None = None) -> int:
    """The most of ``budget`` that root allocations can spend.

    With k prompts open every total in ``[2k, k m_max]`` is reachable, so this is the largest
    ``s <= min(budget, K m_max)`` (``K = min(n, max_prompts)``) with ``2 ceil(s/m_max) <= s``.
    It is ``min(budget, K m_max)`` except: a budget of 1 spends 0, and with ``m_max = 2`` an odd
    total leaves one unit unspent.
    """
    _check_budget(budget)
    if m_max < 2:
        raise ValueError(f"m_max ({m_max}) must be >= 2: an opened prompt gets at least 2 rollouts")
    if max_prompts is not None and max_prompts < 0:
        raise ValueError(f"max_prompts ({max_prompts}) must be >= 0 or None")
    k_cap = n if max_prompts is None else min(n, max_prompts)
    s = min(budget, k_cap * m_max)
    while s > 0 and 2 * math.ceil(s / m_max) > s:
        s -= 1
    return s


def solve_roots(v: Sequence[float], budget: int, m_max: int,
                max_prompts: int | None = None,
                counts: Sequence[float | None] | None = None) -> list[int]:
    """Rollouts per prompt maximising ``sum_i V_root(v_i, m_i)`` (exact; see module docstring).

    Args:
        v: predicted success probability of each candidate prompt, in [0, 1].
        budget: rollouts to spend in total.
        m_max: most rollouts one prompt may get (>= 2).
        max_prompts: most prompts that may be opened (None: no limit).
        counts: how many rollouts each prediction is worth (a Beta belief with mean
            ``v_i``; None entries are exact). When any is given the objective is
            ``sum_i E[V_root(x_i, m_i)]`` (``expected_root_values``), solved by
            ``solve_root_values``.

    Returns:
        ``m`` with ``m_i = 0`` or ``2 <= m_i <= m_max``, at most ``max_prompts`` nonzero, and
        ``sum(m) == spendable_roots(budget, len(v), m_max, max_prompts)``: the whole budget
        whenever it can be spent; otherwise as much as can be (``K m_max`` when the budget
        exceeds what K prompts can take; one unit less for an odd total with ``m_max = 2``;
        0 for a budget of 1).

    The budget is always spent, even when every prompt is worth 0 (v in {0, 1}): equal
    sampling cost across methods requires it. Valued prompts are served first; zero-value
    prompts receive only what is left, and among equal values the solver prefers more
    prompts opened (largest k), then spreads extra rollouts round-robin over prompts in
    order of ``v (1-v)`` (closest to 0.5 first), then index.
    """
    _check_probs("v", v)
    if counts is not None and any(c is not None for c in counts):
        return solve_root_values(expected_root_values(v, counts, m_max), budget, max_prompts)
    n = len(v)
    spend = spendable_roots(budget, n, m_max, max_prompts)
    if spend == 0:
        return [0] * n
    k_cap = n if max_prompts is None else min(n, max_prompts)
    va = np.asarray(v, dtype=np.float64)  # (n,)
    a = va * (1.0 - va)  # (n,) V_root(v, 2) / 2
    a_key = np.round(a, TIE_DECIMALS)  # (n,)
    order = sorted(range(n), key=lambda i: (-a_key[i], i))  # best prompts first
    vo = va[order]  # (n,)
    steps = np.arange(2, m_max)  # (m_max-2,) going from m to m+1 rollouts, m = 2..m_max-1
    gains = vo[:, None] ** steps * (1.0 - vo[:, None]) + (1.0 - vo[:, None]) ** steps * vo[:, None]
    gains = np.minimum.accumulate(gains, axis=1)  # (n, m_max-2) non-increasing against rounding
    open_value = np.concatenate([[0.0], np.cumsum(2.0 * a[order])])  # (n+1,) value of top-k at m=2

    k_lo, k_hi = math.ceil(spend / m_max), min(k_cap, spend // 2)
    assert k_lo <= k_hi, (spend, m_max, k_cap)
    values = []
    for k in range(k_lo, k_hi + 1):
        extra = spend - 2 * k
        flat = gains[:k].ravel()  # (k (m_max-2),)
        if extra == 0:
            ext = 0.0
        elif extra >= flat.size:
            ext = float(flat.sum())
        else:
            ext = float(-np.partition(-flat, extra - 1)[:extra].sum())
        values.append(open_value[k] + ext)
    best = max(values)
    tol = 1e-12 * max(1.0, abs(best))
    k = max(k_lo + j for j, val in enumerate(values) if val >= best - tol)

    extra = spend - 2 * k
    counts = np.full(k, 2, dtype=np.int64)  # (k,)
    if extra > 0:
        rank = np.repeat(np.arange(k), m_max - 2)  # (k (m_max-2),)
        step = np.tile(np.arange(m_max - 2), k)  # (k (m_max-2),)
        key = -np.round(gains[:k].ravel(), TIE_DECIMALS)  # (k (m_max-2),)
        pick = np.lexsort((rank, step, key))[:extra]  # gain desc, then step, then rank
        counts += np.bincount(rank[pick], minlength=k)
    m = [0] * n
    for r, i in enumerate(order[:k]):
        m[i] = int(counts[r])
    assert sum(m) == spend and all(x == 0 or 2 <= x <= m_max for x in m)
    return m


# ---- stage 1 with uncertain predictions ---------------------------------------------------


def beta_moment(a: float, b: float, m: int) -> float:
    """``E[x^m]`` for ``x ~ Beta(a, b)``: ``prod_{i<m} (a + i) / (a + b + i)``.

    ``a = 0`` (or ``b = 0``) is the point mass at 0 (at 1): ``E[x^m] = 0`` (1) for m >= 1.
    """
    out = 1.0
    for i in range(m):
        out *= (a + i) / (a + b + i)
    return out


def expected_root_values(v: Sequence[float], counts: Sequence[float | None],
                         m_max: int) -> np.ndarray:
    """``E[V_root(x, m)]`` per prompt for m = 0..m_max: (n, m_max + 1).

    Prompt i's success probability is a belief ``x ~ Beta(v_i c_i, (1 - v_i) c_i)``: mean
    ``v_i``, worth ``c_i`` rollouts (``PromptHistory``'s posterior has ``c = strength + n``).
    Then, for m >= 2,

        E[V_root(x, m)] = 1 - E[x^m] - E[(1-x)^m]

    (``beta_moment``), the chance that m rollouts of the prompt are mixed; ``c_i = None`` is
    a point prediction (``root_value(v_i, m)``). For the same mean a vaguer belief is worth
    less: v = 0.5 worth 1 rollout gives 0.25 at m = 2 against 0.5 when exact, since the
    prompt may well be one that always fails or always succeeds.
    """
    _check_probs("v", v)
    if len(counts) != len(v):
        raise ValueError(f"counts ({len(counts)}) must give one entry per prediction ({len(v)})")
    out = np.zeros((len(v), m_max + 1))  # (n, m_max+1)
    for i, (vi, c) in enumerate(zip(v, counts)):
        if c is not None and not c > 0:
            raise ValueError(f"counts[{i}] = {c} must be > 0 (rollouts a prediction is worth) "
                             f"or None (an exact prediction)")
        for m in range(2, m_max + 1):
            if c is None or math.isinf(c):
                out[i, m] = root_value(vi, m)
            else:
                a, b = vi * c, (1.0 - vi) * c
                out[i, m] = 1.0 - beta_moment(a, b, m) - beta_moment(b, a, m)
    return out


def solve_root_values(values: np.ndarray, budget: int,
                      max_prompts: int | None = None) -> list[int]:
    """Rollouts per prompt maximising ``sum_i values[i, m_i]`` (exact, by dynamic programming).

    ``values`` (n, m_max + 1) holds any per-prompt value of 0..m_max rollouts (columns 0 and 1
    are not used: ``m_i = 0`` is worth 0 and ``m_i = 1`` is not allowed). Same constraints
    and the same budget rule as ``solve_roots``: ``sum(m) == spendable_roots(...)``. Used for
    ``expected_root_values``, where prompts need not share one order of value for every m
    (the premise of ``solve_roots``' search over k). Cost ``O(n m_max S)`` array work, times
    ``max_prompts`` when that cap binds; ties go to the first optimum found.
    """
    n, width = values.shape
    m_max = width - 1
    spend = spendable_roots(budget, n, m_max, max_prompts)
    if spend == 0:
        return [0] * n
    k_cap = n if max_prompts is None else min(n, max_prompts)
    # track the prompts opened only when the cap can bind: an opened prompt takes at least 2
    # rollouts, so at most spend // 2 open (a cap above that only costs K+1 times the memory)
    rows = k_cap + 1 if k_cap < min(n, spend // 2) else 1
    dp = np.full((rows, spend + 1), -np.inf)  # (K+1 or 1, S+1) best value so far
    dp[0, 0] = 0.0
    choice = np.zeros((n, rows, spend + 1), dtype=np.int16)  # (n, K+1 or 1, S+1)
    for i in range(n):
        best, arg = dp.copy(), np.zeros(dp.shape, dtype=np.int16)  # m_i = 0
        for m in range(2, min(m_max, spend) + 1):
            cand = np.full(dp.shape, -np.inf)
            if rows > 1:
                cand[1:, m:] = dp[:-1, :-m] + values[i, m]
            else:
                cand[:, m:] = dp[:, :-m] + values[i, m]
            better = cand > best + 1e-12
            best, arg = np.where(better, cand, best), np.where(better, m, arg)
        dp, choice[i] = best, arg
    k = int(np.argmax(dp[:, spend]))
    assert np.isfinite(dp[k, spend]), (spend, m_max, k_cap)
    m_out, b = [0] * n, spend
    for i in reversed(range(n)):
        m_out[i] = int(choice[i, k, b])
        b -= m_out[i]
        if rows > 1 and m_out[i]:
            k -= 1
    assert b == 0 and sum(m_out) == spend and all(x == 0 or 2 <= x <= m_max for x in m_out)
    return m_out


# ---- stage 2: prefixes -------------------------------------------------------------------


def _greedy_continuations(q: Sequence[float], start: Sequence[int], budget: int,
                          cap: int | None) -> list[int]:
    """Add up to ``budget`` units to ``start`` greedily on ``q^c (1-q)`` (ties: fewer, index)."""
    counts = list(start)
    heap = [(-round(prefix_gain(qk, c), TIE_DECIMALS), c, k)
            for k, (qk, c) in enumerate(zip(q, counts)) if cap is None or c < cap]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, c, k = heapq.heappop(heap)
        counts[k] = c + 1
        if cap is None or c + 1 < cap:
            heapq.heappush(heap, (-round(prefix_gain(q[k], c + 1), TIE_DECIMALS), c + 1, k))
    return counts


def solve_prefixes(r: Sequence[float], p: Sequence[float], budget: int,
                   cap: int | None = None) -> list[int]:
    """Continuations per prefix maximising ``sum_k 1 - q_k^{c_k}``, ``q = r p + (1-r)(1-p)``.

    Args:
        r: observed terminal reward of the bare rollout each prefix belongs to, in [0, 1].
        p: predicted success probability from each prefix, in [0, 1].
        budget: continuations to spend.
        cap: most continuations per prefix (None: no limit).

    Returns:
        ``c`` with ``sum(c) == min(budget, len(r) * cap)`` (all of it without a cap and with at
        least one prefix). The caller's leftover is ``budget - sum(c)``. Prefixes with
        ``q = 1`` (prediction equals the observed outcome) gain nothing but still absorb
        budget once nothing better is left, round-robin by index.
    """
    if len(r) != len(p):
        raise ValueError(f"r and p must have one entry per prefix (got {len(r)} and {len(p)})")
    _check_probs("r", r)
    _check_probs("p", p)
    _check_budget(budget)
    if cap is not None and cap < 1:
        raise ValueError(f"cap ({cap}) must be >= 1 or None")
    q = [repeat_prob(rk, pk) for rk, pk in zip(r, p)]
    return _greedy_continuations(q, [0] * len(q), budget, cap)


def spend_pool(per_prompt_prefixes: Sequence[Sequence[tuple[float, float]]],
               counts: Sequence[Sequence[int]], pool: int,
               cap: int | None = None) -> tuple[list[list[int]], int]:
    """Phase 2: add ``pool`` continuations greedily over every prompt's prefixes.

    Args:
        per_prompt_prefixes: per prompt, one ``(r, p)`` pair per non-leaf prefix.
        counts: per prompt and prefix, the continuations phase 1 gave it (the start).
        pool: continuations to add.
        cap: most continuations per prefix (None: no limit).

    Returns:
        The new counts (``counts`` plus the pool's) and what no prefix could take.
    """
    _check_budget(pool)
    counts = [list(cs) for cs in counts]
    if pool == 0:
        return counts, 0
    q = [repeat_prob(rk, pk) for prefixes in per_prompt_prefixes for rk, pk in prefixes]
    flat = _greedy_continuations(q, [c for cs in counts for c in cs], pool, cap)
    spent = sum(flat) - sum(sum(cs) for cs in counts)
    return unflatten(flat, [len(cs) for cs in counts]), pool - spent


def draw_random(counts: list[int], budget: int, rng: np.random.Generator,
                cap: int | None = None) -> int:
    """Spend up to ``budget`` units on ``counts`` in place, each on one of the uncapped entries
    uniformly at random (with replacement); returns what was spent (``rng`` advances)."""
    _check_budget(budget)
    open_ = [k for k, c in enumerate(counts) if cap is None or c < cap]
    spent = 0
    while spent < budget and open_:
        j = int(rng.integers(len(open_)))
        k = open_[j]
        counts[k] += 1
        spent += 1
        if cap is not None and counts[k] >= cap:
            open_.pop(j)
    return spent


def unflatten(flat: list[int], sizes: list[int]) -> list[list[int]]:
    """``flat`` cut into consecutive lists of ``sizes``."""
    out, i = [], 0
    for s in sizes:
        out.append(flat[i:i + s])
        i += s
    return out
