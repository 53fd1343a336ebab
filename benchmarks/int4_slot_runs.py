"""How consecutive a request's INT4 cells stay as the allocator's free lists churn.

The Gluon INT4 split reads each token's row from its cell: from a head-major INT4 pool (the
store's, each KV head's cells consecutive rows) it ran 7-15% faster on the H200 when a
request's 32-position blocks sat on consecutive cells (docs/benchmarks.md §3, session 26).
A column asking for at least ``INT4_RUN`` = 32 cells gets them from its fullest aligned runs
of 32 ids, ascending; smaller allocations come off its LIFO free list's top, where cells
freed one by one (per-token eviction) are. This replays a churn of one column with the real
allocator, CPU only, under that policy (``runs``) and under the LIFO list alone (``lifo``,
the policy before session 26: every allocation made of pieces below 32 cells)::

    python3 benchmarks/int4_slot_runs.py --steps 3000 --layouts 1048576 --out int4_slot_runs.json

Each step demotes a new span to INT4 (``alloc_int4``; 256-2,048 tokens while the pool is
under ``--fill``), ends a request (every cell freed), or evicts ``--evict`` of one request's
cells at random positions. It records, per allocation, the fraction of neighbouring
positions whose cells are neighbours too (1.0: one ascending or descending run).

:func:`live_order` gives the GPU benchmarks the steady state of this churn (``decode_splits.py
--slots live``: the live requests' cells), :func:`churned_order` the order the free list
hands every cell out after freeing them all (``--slots churn``). ``--layouts ROWS`` prints,
for those layouts and the others of ``--slots`` on a pool of ROWS rows, the 2 MB pages each
64-position block touches (:func:`pages_per_block`). ``--bulk COLUMNS`` only times a bulk
demotion's ``alloc_int4`` over that many columns (:func:`bulk_alloc_ms`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from agentkv.cache.slot_allocator import INT4_RUN, PoolLayout, SlotAllocator


def run_adjacency(ids: torch.Tensor) -> float:
    """Fraction of neighbouring entries of ``ids`` (int64 [n]) that differ by exactly 1."""
    if ids.numel() < 2:
        return 1.0
    return float(((ids[1:] - ids[:-1]).abs() == 1).double().mean())


def pages_per_block(ids: torch.Tensor, rows_per_page: int = 4096, block: int = 64) -> float:
    """Mean number of distinct pages that each ``block`` consecutive entries of ``ids``
    (int64 ``[n]``, rows of a tensor) touch, a page holding ``rows_per_page`` rows: 4,096
    rows of the INT4 pool's key codes (Hkv 8 x 64 bytes) fill a 2 MB GPU page, and the Gluon
    INT4 split reads 32-64 positions of one request at a time. 1 for consecutive rows; up to
    ``block`` for rows scattered over a pool much larger than a page."""
    n = ids.numel() // block * block
    if n == 0:
        return float(len(torch.unique(ids // rows_per_page))) if ids.numel() else 0.0
    pages = (ids[:n] // rows_per_page).view(-1, block).sort(dim=1).values
    return float(1 + (pages[:, 1:] != pages[:, :-1]).sum(dim=1).double().mean())


def _alloc(alloc: SlotAllocator, n: int, lifo: bool) -> torch.Tensor:
    """``n`` INT4 cells of column 0: one allocation (whole runs first), or with ``lifo`` in
    pieces below ``INT4_RUN``, each off the free list's top (the policy before runs)."""
    if not lifo:
        return alloc.alloc_int4(torch.zeros(n, dtype=torch.int64))
    step = INT4_RUN - 1
    return torch.cat(
        [
            alloc.alloc_int4(torch.zeros(min(step, n - i), dtype=torch.int64))
            for i in range(0, n, step)
        ]
    )


def _churn(
    steps: int,
    cells: int,
    fill: float,
    evict: float,
    seed: int,
    sizes: tuple[int, ...] = (256, 512, 1024, 2048),
    lifo: bool = False,
) -> tuple[SlotAllocator, dict[int, torch.Tensor], list[float]]:
    """The churn of the module docstring on one column of ``cells`` INT4 cells (``lifo``:
    every allocation off the free list's top, see :func:`_alloc`): the allocator, the cells
    of the requests still live at the end, and :func:`run_adjacency` of every
    allocation."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    alloc = SlotAllocator(1, PoolLayout(full_slots=2, int4_slots=cells))
    live: dict[int, torch.Tensor] = {}
    out: list[float] = []
    for step in range(steps):
        r = rng.random()
        used = sum(v.numel() for v in live.values())
        if r < 0.5 and used < fill * cells:
            live[step] = _alloc(alloc, rng.choice(sizes), lifo)
            out.append(run_adjacency(live[step]))
        elif live and r < 0.75:  # a request ends
            alloc.decref(live.pop(rng.choice(sorted(live))).view(1, -1))
        elif live:  # eviction at random positions of one request
            k = rng.choice(sorted(live))
            gone = torch.rand(live[k].numel(), generator=gen) < evict
            alloc.decref(live[k][gone].view(1, -1))
            live[k] = live[k][~gone]
    return alloc, live, out


def churn(
    steps: int,
    cells: int = 200_000,
    fill: float = 0.85,
    evict: float = 0.5,
    seed: int = 0,
    lifo: bool = False,
) -> list[float]:
    """:func:`run_adjacency` of every allocation over ``steps`` churn steps of one column of
    ``cells`` INT4 cells (see the module docstring; ``lifo``: see :func:`_alloc`)."""
    return _churn(steps, cells, fill, evict, seed, lifo=lifo)[2]


def churned_order(cells: int, steps: int = 3000, evict: float = 0.5, seed: int = 0) -> torch.Tensor:
    """int64 ``[cells]``: the INT4 rows (0-based) in the order one column's free list hands
    them all out after ``steps`` churn steps, the requests left at the end freed in random
    order. Request sizes scale with the pool (``cells / 800`` to ``cells / 100``), so every
    pool size sees the same churn. ``decode_attention.py``'s ``--slots churn`` lays the
    benchmark's tokens on rows in this order."""
    sizes = tuple(max(1, round(cells / d)) for d in (800, 400, 200, 100))
    alloc, live, _ = _churn(steps, cells, 0.85, evict, seed, sizes)
    rng = random.Random(seed + 1)
    for k in rng.sample(sorted(live), len(live)):
        alloc.decref(live.pop(k).view(1, -1))
    ids = alloc.alloc_int4(torch.zeros(cells, dtype=torch.int64))
    return ids - alloc.layout.int4_base


def live_order(
    cells: int, steps: int = 3000, evict: float = 0.5, seed: int = 0, lifo: bool = False
) -> torch.Tensor:
    """int64 ``[cells]``: the INT4 rows (0-based) of a steady state: the cells the requests
    still live after ``steps`` churn steps hold (request after request, each in position
    order; per-token eviction has thinned them), then the free cells as further requests
    of the churn's sizes take them. Request sizes scale with the pool as in
    :func:`churned_order`. ``decode_attention.py``'s ``--slots live`` lays the benchmark's
    tokens on rows in this order: what the decode kernel reads after the allocator's churn
    (:func:`churned_order` frees everything first, which with whole-run allocation
    leaves only consecutive runs)."""
    sizes = tuple(max(1, round(cells / d)) for d in (800, 400, 200, 100))
    alloc, live, _ = _churn(steps, cells, 0.85, evict, seed, sizes, lifo)
    rng = random.Random(seed + 1)
    parts = [live[k] for k in sorted(live)]
    left = cells - sum(int(p.numel()) for p in parts)
    while left > 0:
        n = min(rng.choice(sizes), left)
        parts.append(_alloc(alloc, n, lifo))
        left -= n
    return torch.cat(parts) - alloc.layout.int4_base


def bulk_alloc_ms(
    columns: int, cells: int = 32768, rounds: int = 5, seed: int = 0
) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """Host time of a bulk demotion (ms per ``alloc_int4`` call, ``rounds`` calls, one CPU
    thread): ``columns`` columns of ``cells`` INT4 cells, each left with about 70% free
    after a fill and a random release of half of it, ask for 500-2,000 cells each (a
    method demoting a span in every (layer, KV head) column); each allocation is freed
    before the next. Returns the times and the last allocation's columns and ids."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    alloc = SlotAllocator(columns, PoolLayout(full_slots=2, int4_slots=cells))
    filled = cells * 6 // 10
    held = alloc.alloc_int4(torch.arange(columns).repeat_interleave(filled)).view(columns, -1)
    alloc.decref(torch.where(torch.rand(columns, filled, generator=g) < 0.5, 0, held))
    times = []
    for _ in range(rounds):
        cols = torch.repeat_interleave(
            torch.arange(columns), torch.randint(500, 2001, (columns,), generator=g)
        )
        t = time.perf_counter()
        ids = alloc.alloc_int4(cols)
        times.append((time.perf_counter() - t) * 1e3)
        alloc.decref_pairs(cols, ids)
    return times, cols, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--cells", type=int, default=200_000)
    ap.add_argument("--fill", type=float, default=0.85)
    ap.add_argument("--evict", type=float, default=0.5, help="fraction evicted per eviction step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--layouts",
        type=int,
        default=0,
        metavar="ROWS",
        help="also compare the pool-wide layouts of decode_splits.py --slots on a pool of "
        "ROWS rows (2 MB pages per 64-position block, adjacency; e.g. 1048576)",
    )
    ap.add_argument(
        "--bulk",
        type=int,
        default=0,
        metavar="COLUMNS",
        help="only time a bulk INT4 allocation over COLUMNS columns of 32k cells "
        "(bulk_alloc_ms; e.g. 160: 20 layers x 8 KV heads)",
    )
    ap.add_argument("--out", type=Path, default=Path("int4_slot_runs.json"))
    args = ap.parse_args()
    if args.bulk:
        times, _, _ = bulk_alloc_ms(args.bulk, seed=args.seed)
        print(
            f"bulk alloc_int4 over {args.bulk} columns: "
            + ", ".join(f"{t:.1f}" for t in times)
            + " ms"
        )
        return
    layouts = {}
    if args.layouts:
        g = torch.Generator().manual_seed(args.seed)
        rows = args.layouts
        orders = {
            "random": torch.randperm(rows, generator=g),
            "sequential": torch.arange(rows),
            "runs:32": (torch.randperm(rows // 32, generator=g)[:, None] * 32
                        + torch.arange(32)).reshape(-1),
            "churn": churned_order(rows, seed=args.seed),
            "live": live_order(rows, seed=args.seed),
            "live-lifo": live_order(rows, seed=args.seed, lifo=True),
        }  # fmt: skip
        for name, o in orders.items():
            layouts[name] = {"pages_per_block": pages_per_block(o), "adjacency": run_adjacency(o)}
            print(f"{name:>10}: {layouts[name]['pages_per_block']:.2f} 2 MB pages per "
                  f"64-position block, adjacency {layouts[name]['adjacency']:.2f}")  # fmt: skip
    res = {"args": {k: str(v) for k, v in vars(args).items()}, "layouts": layouts}
    for policy, lifo in (("runs", False), ("lifo", True)):
        adj = churn(args.steps, args.cells, args.fill, args.evict, args.seed, lifo)
        # the allocations in consecutive tenths of the run
        tenth = max(1, len(adj) // 10)
        phases = [statistics.mean(adj[i : i + tenth]) for i in range(0, len(adj), tenth)]
        res[policy] = {"allocations": len(adj), "adjacency_by_tenth": phases}
        print(f"{policy}: {len(adj)} allocations; consecutive neighbours by tenth of the run:")
        print(" ".join(f"{p:.2f}" for p in phases))
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
