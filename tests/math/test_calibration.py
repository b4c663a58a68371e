"""Calibration metrics against hand-derived values and brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trace_lightning.math.calibration import (
    average_ranks,
    brier,
    brier_baseline,
    brier_skill,
    expected_calibration_error,
    reliability_curve,
    spearman,
)


def test_brier_and_baseline_by_hand():
    # (0.2 - 0)^2 = (0.8 - 1)^2 = 0.04 -> mean 0.04
    assert brier([0.2, 0.8], [0, 1]) == pytest.approx(0.04, abs=1e-12)
    # constant at mean 0.5: (0.5)^2 both -> 0.25
    assert brier_baseline([0, 1]) == pytest.approx(0.25, abs=1e-12)
    # skill = 1 - 0.04 / 0.25 = 0.84
    assert brier_skill([0.2, 0.8], [0, 1]) == pytest.approx(0.84, abs=1e-12)
    # torch tensors are accepted too
    assert brier(torch.tensor([0.2, 0.8]), torch.tensor([0.0, 1.0])) == pytest.approx(0.04, abs=1e-7)


def test_weighted_brier_by_hand():
    p, y, w = [0.2, 0.8], [0.0, 1.0], [3.0, 1.0]
    # (3 * 0.04 + 1 * 0.04) / 4 = 0.04
    assert brier(p, y, w) == pytest.approx(0.04, abs=1e-12)
    # ybar = 1/4; (3 * 0.25^2 + 1 * 0.75^2) / 4 = (0.1875 + 0.5625) / 4 = 0.1875
    assert brier_baseline(y, w) == pytest.approx(0.1875, abs=1e-12)
    assert brier_skill(p, y, w) == pytest.approx(1 - 0.04 / 0.1875, abs=1e-12)
    # fractional outcomes (node values) work the same: y = 0.5 with p = 0.5 costs nothing
    assert brier([0.5], [0.5]) == 0.0
    # unequal errors: the weights matter, (3 * 0.2^2 + 1 * 0.5^2) / 4 = 0.3700 / 4 = 0.0925
    assert brier([0.2, 0.5], [0.0, 1.0], [3.0, 1.0]) == pytest.approx(0.0925, abs=1e-12)


def test_brier_skill_against_a_reference_constant_by_hand():
    # constant .3 on (0, 1): (.09 + .49) / 2 = .29 = .25 + (.3 - .5)^2
    assert brier_skill([0.2, 0.8], [0, 1], reference=0.3) == pytest.approx(1 - 0.04 / 0.29)
    # weighted: w (3, 1) on (0, 1) at .5: (3 * .25 + .25) / 4 = .25; p (.2 .5): .0925
    assert brier_skill([0.2, 0.5], [0.0, 1.0], [3.0, 1.0], reference=0.5) == pytest.approx(
        1 - 0.0925 / 0.25)
    # the reference at the weighted mean is the hindsight baseline
    assert brier_skill([0.2, 0.5], [0.0, 1.0], [3.0, 1.0], reference=0.25) == pytest.approx(
        brier_skill([0.2, 0.5], [0.0, 1.0], [3.0, 1.0]))
    # outcomes equal to the reference: nothing to beat
    assert math.isnan(brier_skill([0.3, 0.6], [1, 1], reference=1.0))
    # but equal outcomes away from it: a constant prediction elsewhere is beaten
    assert brier_skill([1.0, 1.0], [1, 1], reference=0.5) == 1.0


def test_brier_skill_undefined_for_constant_outcomes():
    assert math.isnan(brier_skill([0.3, 0.6], [1, 1]))


def test_ece_two_bins_by_hand():
    p, y = [0.1, 0.3, 0.6, 0.9], [0, 1, 1, 1]
    # bin [0, .5): p {0.1, 0.3} mean 0.2, y mean 0.5 -> |.| 0.3, weight 2
    # bin [.5, 1]: p {0.6, 0.9} mean 0.75, y mean 1.0 -> |.| 0.25, weight 2
    # ECE = (2 * 0.3 + 2 * 0.25) / 4 = 0.275
    assert expected_calibration_error(p, y, bins=2) == pytest.approx(0.275, abs=1e-12)
    # weights [1, 1, 2, 0]: bin 1 holds only p=0.6 (w 2): |0.6 - 1| = 0.4
    # ECE = (2 * 0.3 + 2 * 0.4) / 4 = 0.35
    assert expected_calibration_error(p, y, [1, 1, 2, 0], bins=2) == pytest.approx(0.35,
                                                                                 abs=1e-12)
    # a perfectly calibrated pair of bins has ECE 0; p = 1.0 falls in the last bin
    assert expected_calibration_error([0.25, 0.25, 1.0], [0.5, 0.0, 1.0], bins=4) == \
        pytest.approx(0.0, abs=1e-12)


def test_reliability_curve_bins():
    mean_p, mean_y, weight = reliability_curve([0.1, 0.3, 0.95], [0, 1, 1], [1, 3, 2], bins=4)
    # bins [0,.25) [.25,.5) [.5,.75) [.75,1]
    np.testing.assert_allclose(weight, [1, 3, 0, 2])
    np.testing.assert_allclose(mean_p[[0, 1, 3]], [0.1, 0.3, 0.95])
    np.testing.assert_allclose(mean_y[[0, 1, 3]], [0, 1, 1])
    assert math.isnan(mean_p[2]) and math.isnan(mean_y[2])


def _brute_ranks(x):
    # rank_i = 1 + #(x_j < x_i) + (#(x_j == x_i) - 1) / 2
    return np.array([1 + sum(b < a for b in x) + (sum(b == a for b in x) - 1) / 2 for a in x])


def test_average_ranks_with_ties():
    # sorted: 1 (rank 1), 2, 2 (ranks 2,3 -> 2.5), 5 (rank 4)
    np.testing.assert_allclose(average_ranks([2, 5, 1, 2]), [2.5, 4, 1, 2.5])


def test_spearman_vs_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p = rng.integers(0, 5, size=12).astype(float)  # many ties
        y = rng.integers(0, 3, size=12).astype(float)
        rp, ry = _brute_ranks(p), _brute_ranks(y)
        if rp.std() == 0 or ry.std() == 0:
            assert math.isnan(spearman(p, y))
        else:
            assert spearman(p, y) == pytest.approx(np.corrcoef(rp, ry)[0, 1], abs=1e-12)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([0.1, 0.7, 0.3], [0.0, 1.0, 0.5]) == pytest.approx(1.0)
    assert math.isnan(spearman([0.5, 0.5, 0.5], [0, 1, 1]))  # undefined, not "no correlation"


def test_outcomes_equal_but_for_rounding_are_constant():
    """F1 rewards: a node's value is a mean of the same leaf rewards summed in another order.
    Leaves all 0.7: a 3-leaf node's mean is 0.6999999999999998; by hand the baseline is 0
    and skill and rank correlation are undefined (they were -1.2e31 and 1.0)."""
    y = [0.7, (0.7 + 0.7 + 0.7) / 3]
    assert y[0] != y[1]
    assert brier_baseline(y, [4, 3]) == 0.0
    assert math.isnan(brier_skill([0.5, 0.4], y, [4, 3]))
    assert math.isnan(spearman([0.5, 0.4], y))
    assert spearman([0.5, 0.4, 0.1], [*y, 0.0]) == pytest.approx(math.sqrt(3) / 2)  # a tie
