"""Rollout correction: the sampler's and the trainer's log-probs of the same tokens.

Pure torch, tensors in, ``(weights, stats)`` out. The sampler (vLLM, bf16 on GPU) and the
trainer (FSDP, bf16 compute) give the same token different log-probs; with ``pi_old`` the
trainer's policy at the step's start weights and ``pi_rollout`` the sampler's, each sampled
token has the ratio::

    rho_t = pi_old(t) / pi_rollout(t) = exp(clamp(old_t - rollout_t, -20, 20))

**Mismatch** (``mismatch_stats``), over (leaf, token) pairs sampled from ``pi_rollout``::

    k1 = mean(-log rho_t)                      KL(pi_rollout || pi_old), k1 estimator
    k3 = mean(rho_t - 1 - log rho_t)           the same KL, k3 estimator (>= 0 per token)
    max_ratio = max rho_t,  min_ratio = min rho_t
    share_past_bound = share of pairs with rho_t > C or rho_t < 1 / C

**Weights** (``correction_weights``), verl's ``algorithm.rollout_correction`` semantics
(decoupled mode: the loss's ratio is ``pi / pi_old``, these weights carry ``pi_old /
pi_rollout``; they are detached: they change the measure, not the objective)::

    rollout_is = "token":     w_t = min(rho_t, C)                             (token TIS)
    rollout_is = "sequence":  w_l = min(exp(clamp(sum_{t in l} log rho_t)), C) (sequence TIS)
    rollout_rs = "token":     keep_t = 1[lo <= rho_t <= hi]                    (token MIS)
    rollout_rs = "sequence":  keep_l = 1[lo <= exp(clamp(sum_t log rho_t)) <= hi]  (sequence MIS)
    rollout_rs = "geometric": keep_l = 1[lo <= exp(mean_t log rho_t) <= hi]
    veto v:                   keep_l = 0 if any rho_t < v in the leaf (before the clamp)
    weight = w * keep                (w = 1 without rollout_is, keep = 1 without rollout_rs)

``C`` is ``rollout_is_threshold``; ``hi`` is ``rollout_rs_threshold`` (default ``C``) and
``lo`` ``rollout_rs_threshold_lower`` (default ``1 / hi``). A sequence here is a leaf: the
sum runs over the policy tokens of its root-to-leaf path.

Pairs, not tokens: in a packed tree a shared token stands for one (leaf, token) pair per leaf
through it (``trace_lightning.packing.trees``). Token-level weights are the same for
every pair of a token (one context, one ratio); sequence-level ones differ per leaf, so the
weights are computed per pair and folded into the loss's per-token sums
(``fold_pair_weights``): a token's ``adv_pos`` becomes ``sum_l w_l max(A_l, 0)`` over its
leaves. With one leaf per row this is the per-leaf weighting exactly.

Deviation from verl: a rejected pair keeps its place in the token-mean's divisor (its term is
0), because the divisor is fixed for the whole mini-batch before its first micro-batch runs.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

RolloutIS = Literal["token", "sequence"]
RolloutRS = Literal["token", "sequence", "geometric"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = get_args(RolloutIS)
ROLLOUT_RS_LEVELS: tuple[str, ...] = get_args(RolloutRS)
SAFETY_BOUND = 20.0  # log-ratios are clamped to [-20, 20] before exp (as verl does)


def log_ratios(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
               count: torch.Tensor) -> torch.Tensor:
    """``log rho`` = trainer minus sampler log-probs where ``count > 0``, 0 elsewhere.

    Args:
        logprobs: ``(B, T)`` the trainer's log-probs (detached here).
        rollout_logprobs: ``(B, T)`` the sampler's.
        count: ``(B, T)`` pairs per token (0 off policy tokens).
    """
    d = logprobs.detach().double() - rollout_logprobs.double()  # (B, T)
    return torch.where(count > 0, d, torch.zeros_like(d))  # (B, T)


def mismatch_stats(log_rho: torch.Tensor, count: torch.Tensor,
                   bound: float) -> dict[str, torch.Tensor]:
    """The mismatch between the trainer and the sampler (see the module doc).

    Args:
        log_rho: ``(B, T)`` ``log_ratios``.
        count: ``(B, T)`` pairs per token (each token weighs its pairs, as in the loss).
        bound: ``C``: a pair is past the bound when ``rho > C`` or ``rho < 1 / C``.

    Returns:
        detached scalars: ``k1_kl``, ``k3_kl``, ``share_past_bound`` (means over pairs),
        ``max_ratio``, ``min_ratio`` (0 and inf when there is no pair: neutral in a max and
        a min over micro-batches), ``pairs``.
    """
    w = count.double()  # (B, T)
    valid = w > 0  # (B, T)
    n = w.sum()  # ()
    lr = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    rho = torch.exp(lr)  # (B, T)
    k3 = rho - 1.0 - lr  # (B, T): >= 0
    past = (rho > bound) | (rho < 1.0 / bound)  # (B, T)
    inf = torch.full_like(rho, math.inf)  # (B, T)
    return {"k1_kl": (-lr * w).sum() / n.clamp(min=1.0),
            "k3_kl": (k3 * w).sum() / n.clamp(min=1.0),
            "share_past_bound": (past * w).sum() / n.clamp(min=1.0),
            "max_ratio": torch.where(valid, rho, torch.zeros_like(rho)).max(),
            "min_ratio": torch.where(valid, rho, inf).min(),
            "pairs": n}


def correction_weights(pair_log_rho: torch.Tensor, pair_leaf: torch.Tensor, n_leaves: int,
                       rollout_is: RolloutIS | None = None, rollout_is_threshold: float = 2.0,
                       rollout_rs: RolloutRS | None = None,
                       rollout_rs_threshold: float | None = None,
                       rollout_rs_threshold_lower: float | None = None,
                       rollout_token_veto_threshold: float | None = None,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each (leaf, token) pair's correction weight (see the module doc for the formulas).

    Args:
        pair_log_rho: ``(P,)`` ``log rho`` of each pair's token.
        pair_leaf: ``(P,)`` long, the leaf (0 .. n_leaves - 1) each pair belongs to.
        n_leaves: the number of leaves.
        rollout_is: "token" / "sequence" truncated IS weights, or None (weight 1).
        rollout_is_threshold: ``C``, the truncation of the IS weights (> 0).
        rollout_rs: "token" / "sequence" / "geometric" rejection, or None.
        rollout_rs_threshold: ``hi`` (None: ``rollout_is_threshold``).
        rollout_rs_threshold_lower: ``lo`` (None: ``1 / hi``).
        rollout_token_veto_threshold: reject a leaf holding a token with ``rho`` below this
            (None: no veto).

    Returns:
        ``weights (P,)`` float64, detached, >= 0, and detached scalar stats, means over
        pairs: ``is_truncated_share`` (the IS weight was cut at ``C``), ``rejected_share``
        (weight 0 from the rejection or the veto), ``veto_share`` (in a vetoed leaf),
        ``weight_mean``.
    """
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is ({rollout_is!r}): expected one of {ROLLOUT_IS_LEVELS} "
                         f"or None")
    if rollout_rs is not None and rollout_rs not in ROLLOUT_RS_LEVELS:
        raise ValueError(f"rollout_rs ({rollout_rs!r}): expected one of {ROLLOUT_RS_LEVELS} "
                         f"or None")
    lr = pair_log_rho.detach().double()  # (P,)
    leaf = pair_leaf.long()  # (P,)
    p = lr.numel()

    def per_leaf(values: torch.Tensor, reduce: str) -> torch.Tensor:  # (P,) -> (L,)
        return torch.zeros(n_leaves, dtype=values.dtype, device=values.device).scatter_reduce(
            0, leaf, values, reduce=reduce, include_self=False)

    leaf_sum = per_leaf(lr, "sum")  # (L,): log of the leaf's product of ratios
    leaf_n = per_leaf(torch.ones_like(lr), "sum").clamp(min=1.0)  # (L,)
    token_rho = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (P,)
    seq_rho = torch.exp(leaf_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND))[leaf]  # (P,)
    geo_rho = torch.exp((leaf_sum / leaf_n).clamp(-SAFETY_BOUND, SAFETY_BOUND))[leaf]  # (P,)

    weights = torch.ones_like(lr)  # (P,)
    truncated = torch.zeros_like(lr)  # (P,)
    if rollout_is is not None:
        rho = token_rho if rollout_is == "token" else seq_rho  # (P,)
        truncated = (rho > rollout_is_threshold).double()  # (P,)
        weights = rho.clamp(max=rollout_is_threshold)  # (P,)
    keep = torch.ones_like(lr)  # (P,)
    if rollout_rs is not None:
        hi = rollout_rs_threshold if rollout_rs_threshold is not None else rollout_is_threshold
        lo = rollout_rs_threshold_lower if rollout_rs_threshold_lower is not None else 1.0 / hi
        rho = {"token": token_rho, "sequence": seq_rho, "geometric": geo_rho}[rollout_rs]  # (P,)
        keep = ((rho >= lo) & (rho <= hi)).double()  # (P,)
    vetoed = torch.zeros_like(lr)  # (P,)
    if rollout_token_veto_threshold is not None:
        low = (lr < torch.log(torch.tensor(rollout_token_veto_threshold,
                                           dtype=lr.dtype))).double()  # (P,)
        vetoed = per_leaf(low, "amax")[leaf] if p else low  # (P,): 1 in a vetoed leaf
        keep = keep * (1.0 - vetoed)  # (P,)
    weights = weights * keep  # (P,)
    n = max(p, 1)
    stats = {"is_truncated_share": truncated.sum() / n, "rejected_share": (1 - keep).sum() / n,
             "veto_share": vetoed.sum() / n, "weight_mean": weights.sum() / n}
    return weights, stats


def fold_pair_weights(pair_weight: torch.Tensor, pair_row: torch.Tensor,
                      pair_pos: torch.Tensor, pair_adv: torch.Tensor,
                      weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The loss's per-token weights with each pair's advantage scaled by its weight.

    ``adv_pos[r, t] = sum over pairs at (r, t) of weight * max(A, 0)`` (``adv_neg`` alike);
    ``count``, ``n_pos`` and ``n_neg`` are unchanged (the divisor, the KL term and the clip
    statistics still count every pair).

    Args:
        pair_weight: ``(P,)`` ``correction_weights``.
        pair_row, pair_pos: ``(P,)`` long, each pair's token in the ``(B, T)`` layout.
        pair_adv: ``(P,)`` each pair's advantage.
        weights: ``(B, T)`` each, the uncorrected weights (``WEIGHT_KEYS``).

    Returns:
        the weights with ``adv_pos`` / ``adv_neg`` replaced, ``(B, T)`` float64 each.
    """
    out = dict(weights)
    a = pair_adv.double() * pair_weight.double()  # (P,)
    for key, part in (("adv_pos", a.clamp(min=0.0)), ("adv_neg", a.clamp(max=0.0))):
        base = weights[key]  # (B, T)
        # float64, as packed trees' sums are (a weight times a float32 advantage is exact)
        out[key] = torch.zeros(base.shape, dtype=torch.float64, device=base.device).index_put(
            (pair_row, pair_pos), part, accumulate=True)  # (B, T)
    return out
