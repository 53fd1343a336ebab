"""benchmarks/int4_slot_runs.py on the real SlotAllocator (CPU): whole-request frees keep
INT4 allocations in runs of neighbouring cells; per-token eviction scatters a LIFO free
list's later allocations, while bulk allocations from whole free runs stay consecutive."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import int4_slot_runs  # noqa: E402


def test_run_adjacency() -> None:
    assert int4_slot_runs.run_adjacency(torch.tensor([5, 6, 7, 8])) == 1.0
    assert int4_slot_runs.run_adjacency(torch.tensor([9, 8, 7])) == 1.0
    assert int4_slot_runs.run_adjacency(torch.tensor([1, 3, 4, 9, 10])) == 0.5
    assert int4_slot_runs.run_adjacency(torch.tensor([4])) == 1.0


def test_whole_frees_keep_runs_and_scattered_evictions_break_lifo_ones() -> None:
    for lifo in (False, True):
        whole = int4_slot_runs.churn(300, cells=20_000, evict=0.0, lifo=lifo)
        assert len(whole) > 50 and min(whole) > 0.99 and whole[0] == 1.0
    late = {}
    for lifo in (False, True):
        scattered = int4_slot_runs.churn(300, cells=20_000, evict=0.5, lifo=lifo)
        assert scattered[0] == 1.0  # a fresh pool: one ascending run
        half = scattered[len(scattered) // 2 :]
        late[lifo] = sum(half) / len(half)
    # bulk allocations from whole free runs keep far more neighbours than the LIFO list
    assert late[True] < 0.6 and late[False] > late[True] + 0.15, late


def test_pages_per_block() -> None:
    """Distinct pages per block: 1 for consecutive rows, 2 for a block straddling two pages
    or made of two runs, the block's size for rows each on its own page."""
    assert int4_slot_runs.pages_per_block(torch.arange(128), rows_per_page=64) == 1.0
    two = torch.cat([torch.arange(32) + 1000, torch.arange(32) + 9000])
    assert int4_slot_runs.pages_per_block(two, rows_per_page=4096) == 2.0
    spread = torch.arange(64) * 4096
    assert int4_slot_runs.pages_per_block(spread, rows_per_page=4096) == 64.0
    churned = int4_slot_runs.churned_order(40_000)
    scattered = torch.randperm(40_000, generator=torch.Generator().manual_seed(0))
    assert (
        int4_slot_runs.pages_per_block(churned, 512)
        < int4_slot_runs.pages_per_block(scattered, 512) / 4
    )


def test_live_order_is_the_steady_state_in_runs() -> None:
    """The live requests' cells then the free ones: every row once; its 32-position blocks
    touch a few 32-row runs (per-token eviction thinned the requests), the LIFO list's
    several times more."""
    runs = int4_slot_runs.live_order(40_000)
    lifo = int4_slot_runs.live_order(40_000, lifo=True)
    for order in (runs, lifo):
        assert torch.equal(order.sort().values, torch.arange(40_000))
    per_block = {
        name: int4_slot_runs.pages_per_block(o, rows_per_page=32, block=32)
        for name, o in (("runs", runs), ("lifo", lifo))
    }
    assert per_block["runs"] < 4 and per_block["lifo"] > 2 * per_block["runs"], per_block


def test_bulk_alloc_ms_times_a_valid_allocation() -> None:
    """The bulk-demotion timer allocates 500-2,000 INT4 cells per column, distinct within
    each column, and they come back to the free lists (each round allocates again)."""
    times, cols, ids = int4_slot_runs.bulk_alloc_ms(4, cells=8192, rounds=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    per_col = torch.bincount(cols, minlength=4)
    assert bool(((per_col >= 500) & (per_col <= 2000)).all())
    assert (cols * 100_000 + ids).unique().numel() == ids.numel()
    assert int(ids.min()) >= 2 and int(ids.max()) < 2 + 8192  # (the INT4 ids)
