"""Trajectory-level (cluster) bootstrap intervals for replay metrics.

Turns of one trajectory share their context, so they are not independent samples: the
intervals resample whole trajectories. Metrics are ratios of sums over trajectories (e.g.
agreeing tokens / scored tokens), recomputed on every resample; the interval is the
percentile interval of those. Seeded, so a report is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

RESAMPLES = 2000


def ratio_ci(
    numerator: Sequence[float],
    denominator: Sequence[float],
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Interval of ``sum(numerator) / sum(denominator)``; one entry per trajectory."""
    num, den = _arrays(numerator, denominator)
    idx = _draws(len(num), resamples, seed)
    return _interval(num[idx].sum(axis=1) / np.maximum(den[idx].sum(axis=1), 1e-12), level)


def paired_difference_ci(
    numerator_a: Sequence[float],
    numerator_b: Sequence[float],
    denominator: Sequence[float],
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``(estimate, lo, hi)`` of ``(sum(a) - sum(b)) / sum(denominator)`` for two policies run
    on the same trajectories (entry i of each is trajectory i): the same draws for both, so
    the trajectory-to-trajectory spread they share cancels."""
    a, b, den = _arrays(numerator_a, numerator_b, denominator)
    idx = _draws(len(a), resamples, seed)
    diffs = (a[idx].sum(axis=1) - b[idx].sum(axis=1)) / np.maximum(den[idx].sum(axis=1), 1e-12)
    return (float((a.sum() - b.sum()) / max(den.sum(), 1e-12)), *_interval(diffs, level))


def _arrays(*columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=np.float64) for c in columns]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1 or not len(arrays[0]):
        raise ValueError("need one value per trajectory, the same trajectories in every column")
    return arrays


def _draws(n: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, n]`` trajectory indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
