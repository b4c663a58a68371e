"""Calibration metrics for the success predictor (pure functions; numpy or torch in, floats out).

With predictions ``p_i``, outcomes ``y_i`` in [0, 1] (a leaf reward or a node's mean leaf
reward) and weights ``w_i`` (``n_leaves``; 1 when omitted), ``W = sum_i w_i``:

- Brier score:      ``B = sum_i w_i (p_i - y_i)^2 / W``
- Baseline:         ``B0 = sum_i w_i (ybar - y_i)^2 / W``, ``ybar = sum_i w_i y_i / W``
                    (the best constant predictor on these very outcomes)
- Brier skill:      ``1 - B / B0``; > 0 beats the constant, 1 is perfect; NaN when every
                    outcome is the same (``B0 = 0``: no skill to measure).
                    ``ybar`` is known only in hindsight; against a constant ``c`` fixed
                    beforehand (``reference``: e.g. the last step's mean outcome) the
                    baseline is ``sum_i w_i (c - y_i)^2 / W = B0 + (c - ybar)^2``.
- ECE:              equal-width bins over [0, 1] (``p = 1`` falls in the last bin);
                    ``sum_b (W_b / W) |pbar_b - ybar_b|`` with weighted means per bin.
- Spearman:         Pearson correlation of average ranks (ties share their mean rank);
                    NaN when either side is constant. Unweighted.

Values that differ only by floating-point rounding (F1 rewards: means of the same leaf
rewards summed in another order) count as equal: everything is compared at ``DECIMALS``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

DECIMALS = 9  # equal to this many decimals: equal (rounding noise neither ranks nor varies)


def _arr(x: Any) -> np.ndarray:
    """A flat float64 array from a list, numpy array or torch tensor."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def _rounded(x: Any) -> np.ndarray:
    return np.round(_arr(x), DECIMALS)


def _weights(y: np.ndarray, w: Any) -> np.ndarray:
    w = np.ones_like(y) if w is None else _arr(w)
    if w.shape != y.shape:
        raise ValueError(f"weights have shape {w.shape}, outcomes {y.shape}; pass one weight "
                         f"per outcome")
    if np.any(w < 0):
        raise ValueError("weights must be >= 0")
    return w


def brier(p: Any, y: Any, w: Any = None) -> float:
    """Weighted mean squared error of probabilities ``p`` against outcomes ``y``."""
    p, y = _arr(p), _arr(y)
    w = _weights(y, w)
    return float(np.sum(w * (p - y) ** 2) / np.sum(w)) if np.sum(w) > 0 else float("nan")


def brier_baseline(y: Any, w: Any = None) -> float:
    """Brier score of the constant predictor at the weighted mean outcome (0 when the
    outcomes are equal to ``DECIMALS``)."""
    y = _rounded(y)
    w = _weights(y, w)
    if np.sum(w) <= 0:
        return float("nan")
    if np.ptp(y[w > 0]) == 0:  # exactly 0, not the rounding noise of the weighted mean
        return 0.0
    ybar = np.sum(w * y) / np.sum(w)
    return float(np.sum(w * (ybar - y) ** 2) / np.sum(w))


def brier_skill(p: Any, y: Any, w: Any = None, reference: float | None = None) -> float:
    """``1 - brier / baseline``: against ``brier_baseline`` (the outcomes' own weighted mean),
    or against the constant ``reference`` when one is given; NaN when the baseline is 0."""
    if reference is None:
        base = brier_baseline(y, w)
    else:
        y_arr = _arr(y)
        base = brier(np.full_like(y_arr, float(reference)), y_arr, w)
    if not base > 0:
        return float("nan")
    return 1.0 - brier(p, y, w) / base


def reliability_curve(p: Any, y: Any, w: Any = None, bins: int = 10
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width bin: (mean prediction, mean outcome, total weight), each (bins,).

    Empty bins have NaN means and weight 0.
    """
    if bins < 1:
        raise ValueError(f"bins ({bins}) must be >= 1")
    p, y = _arr(p), _arr(y)
    w = _weights(y, w)
    idx = np.clip(np.floor(p * bins).astype(np.int64), 0, bins - 1)  # (N,)
    weight = np.bincount(idx, weights=w, minlength=bins)  # (bins,)
    sum_p = np.bincount(idx, weights=w * p, minlength=bins)  # (bins,)
    sum_y = np.bincount(idx, weights=w * y, minlength=bins)  # (bins,)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.where(weight > 0, sum_p / weight, np.nan)  # (bins,)
        mean_y = np.where(weight > 0, sum_y / weight, np.nan)  # (bins,)
    return mean_p, mean_y, weight


def expected_calibration_error(p: Any, y: Any, w: Any = None, bins: int = 10) -> float:
    """Weighted ECE over ``bins`` equal-width bins."""
    mean_p, mean_y, weight = reliability_curve(p, y, w, bins)
    total = weight.sum()
    if total <= 0:
        return float("nan")
    keep = weight > 0
    return float(np.sum(weight[keep] * np.abs(mean_p[keep] - mean_y[keep])) / total)


def average_ranks(x: Any) -> np.ndarray:
    """Ranks 1..N; tied values (equal to ``DECIMALS``) share the mean of the ranks they span."""
    x = _rounded(x)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    ranks = np.empty(len(x))
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + 1 + end) / 2.0  # mean of ranks start+1..end
            start = end
    return ranks


def spearman(p: Any, y: Any) -> float:
    """Spearman rank correlation (average ranks for ties); NaN if either side is constant."""
    rp, ry = average_ranks(p), average_ranks(y)
    if len(rp) != len(ry):
        raise ValueError(f"spearman needs equal lengths, got {len(rp)} and {len(ry)}")
    rp, ry = rp - rp.mean(), ry - ry.mean()
    denom = np.sqrt(np.sum(rp ** 2) * np.sum(ry ** 2))
    return float(np.sum(rp * ry) / denom) if denom > 0 else float("nan")


__all__ = ["average_ranks", "brier", "brier_baseline", "brier_skill",
           "expected_calibration_error", "reliability_curve", "spearman"]
