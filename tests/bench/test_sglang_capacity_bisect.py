"""``sglang_plugin.py capacity --bisect``: the bisection between the last holding and the first
failing level (no server: ``holds`` is a threshold here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sglang_plugin import bisect_capacity  # noqa: E402


def test_bisection_finds_the_threshold_with_few_runs():
    runs: list[int] = []

    def holds(level: int) -> bool:
        runs.append(level)
        return level <= 203

    assert bisect_capacity(192, 256, holds) == (203, 204)
    assert len(runs) == 6  # log2(64)
    assert all(192 < x < 256 for x in runs)


def test_adjacent_levels_run_nothing():
    assert bisect_capacity(48, 49, lambda level: 1 / 0) == (48, 49)


def test_from_zero_when_no_level_held():
    assert bisect_capacity(0, 16, lambda level: level <= 5) == (5, 6)
