"""benchmarks/kv_store_host.py on the CPU at a tiny shape: every move runs and is reported
per cell (the figures themselves are the GPU host's, docs/benchmarks.md §3 session 31)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kv_store_host  # noqa: E402


def test_every_move_is_timed_per_cell() -> None:
    args = argparse.Namespace(
        shape="2,2,32", kv_slots=2048, tokens=512, pages=3, device="cpu", seed=0
    )
    row = kv_store_host.run(args)
    assert len(row["page_ms"]) == 3 and row["page_ms_median"] > 0
    assert row["demote_ns_per_cell"] > 0 and row["evict_ns_per_evicted_cell"] > 0
    assert row["cells_moved"] > 0 and row["compact_ns_per_moved_cell"] > 0
    # the index followed every page in place and holds what a rebuild holds
    assert None not in row["index_advance_ms"] and row["index_advance_matches_build"] is True
