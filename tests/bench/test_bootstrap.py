"""Trajectory-level bootstrap intervals: exact answers on small, hand-checkable inputs."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.bench.bootstrap import paired_difference_ci, ratio_ci


def test_one_trajectory_has_nothing_to_resample():
    assert ratio_ci([3.0], [4.0]) == (0.75, 0.75)


def test_two_trajectories_give_the_extremes_a_quarter_of_the_time_each():
    # resamples: (a, a) -> 0.5, (b, b) -> 1.0, mixed -> 0.75; 2.5% and 97.5% hit the extremes
    assert ratio_ci([5, 10], [10, 10]) == (0.5, 1.0)
    # the central 40% lies inside the mixed half, token-weighted like the point estimate
    assert ratio_ci([0, 99], [1, 99], level=0.4) == pytest.approx((0.99, 0.99))


def test_interval_tightens_with_more_trajectories_and_is_seeded():
    rng = np.random.default_rng(1)
    tokens = rng.integers(50, 200, size=400).astype(float)
    agree = rng.binomial(tokens.astype(int), 0.9).astype(float)
    narrow = ratio_ci(agree, tokens)
    wide = ratio_ci(agree[:20], tokens[:20])
    assert narrow[1] - narrow[0] < (wide[1] - wide[0]) / 2
    assert narrow[0] < agree.sum() / tokens.sum() < narrow[1]
    assert ratio_ci(agree, tokens) == narrow
    assert ratio_ci(agree, tokens, seed=1) != narrow


def test_pairing_cancels_shared_spread():
    """Two policies tracking the same hard and easy trajectories: unpaired intervals overlap,
    the paired difference is clearly positive."""
    rng = np.random.default_rng(0)
    tokens = np.full(50, 100.0)
    difficulty = rng.uniform(0.6, 1.0, size=50) * 100
    a, b = difficulty, difficulty - 1.0  # a agrees on one more token per trajectory
    lo_a, hi_a = ratio_ci(a, tokens)
    lo_b, hi_b = ratio_ci(b, tokens)
    assert lo_a < hi_b  # overlap
    estimate, lo, hi = paired_difference_ci(a, b, tokens)
    assert estimate == pytest.approx(0.01)
    assert (lo, hi) == pytest.approx((0.01, 0.01))


def test_bad_input():
    with pytest.raises(ValueError, match="one value per trajectory"):
        ratio_ci([1.0, 2.0], [3.0])
    with pytest.raises(ValueError, match="one value per trajectory"):
        ratio_ci([], [])
    with pytest.raises(ValueError, match="level"):
        ratio_ci([1.0], [1.0], level=1.5)
