"""benchmarks/int4_compaction.py on the CPU (torch backend, no timings): per-token eviction
thins the store's INT4 runs, compaction fills them again without changing the kernel's
output or the resident bytes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import int4_compaction  # noqa: E402


def test_thinned_runs_compact_to_whole_runs_with_the_same_output() -> None:
    args = argparse.Namespace(batch=2, tokens=1024, layers=1, seed=0, min_density=0.75)
    full = int4_compaction.run_keep(args, 1.0, "torch")
    assert full["density_before"] == 1.0 and full["cells_moved"] == 0
    half = int4_compaction.run_keep(args, 0.5, "torch")
    assert 0.4 < half["density_before"] < 0.6
    assert half["density_after"] > 0.95 and half["cells_moved"] > 0.4 * 2 * 8 * 1024
    assert half["rel_err_compacted_vs_sparse"] < 1e-3
    assert half["sparse_us"] is None and half["live_positions"] < 600
