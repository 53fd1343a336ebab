"""What per-token eviction costs the INT4 decode kernel, and what ``KVStore.compact_int4`` wins
back, on the store's own pools.

For each ``--keep`` fraction: a real :class:`~agentkv.cache.KVStore` (``--layers`` layers,
Hkv 8, D 128, bf16, head-major INT4 pools) holds ``--batch`` requests of ``--tokens``
positions, each demoted to INT4 whole (the allocator hands each (layer, KV head) column its
span as consecutive runs), then thinned by per-token, per-head eviction keeping ``keep`` of
the cells at random. Timed (CUDA graph, L2 flushed, µs per call, layer 0):

- ``sparse``: ``decode_attention`` over every request's live INT4 cells in row order, as
  the engine's ``DecodeIndex`` lists them: what a decode step reads after the eviction;
- ``compacted``: the same after ``compact_int4`` on every request (the cells copied into
  fuller runs);
- ``sdpa``: bf16 SDPA over the same number of live positions per request (dense K/V);

and the compaction itself (all layers, ms, and its host part per moved cell; per layer it
is paid once, the decode kernel's gain on every step: ``break_even_steps``; the store's
other moves per cell: ``kv_store_host.py``). The two kernel outputs are compared (the same
values, summed in another order: a relative error near fp32 rounding)::

    python3 benchmarks/int4_compaction.py --batch 8 --tokens 32768 --keep 1,0.9,0.75,0.5,0.25 \\
        --out int4_compaction.json

On a CPU it runs the same steps at a small size (``--batch 2 --tokens 2048``) with the
torch backend and no timings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention import DEVICE, HKV, HQ, D, _kernel_us, _rel  # noqa: E402

from agentkv.cache import DEAD, KVStore, Precision  # noqa: E402
from agentkv.kernels import SegmentMaxLens, decode_attention  # noqa: E402


def build_store(batch: int, tokens: int, layers: int, keep: float, seed: int = 0):
    """The store and its ``batch`` requests: ``tokens`` positions each, written with random
    K/V, demoted to INT4 whole, then ``keep`` of each column's cells kept at random (per
    (layer, KV head, position), ``keep`` >= 1: none evicted)."""
    g = torch.Generator().manual_seed(seed)
    n = batch * tokens
    store = KVStore(
        layers,
        HKV,
        D,
        num_slots=n + 2,
        dtype=torch.bfloat16,
        device=DEVICE,
        int4_slots=n + n // 4,
        int2_pages=0,
    )
    reqs = []
    for r in range(batch):
        req = store.begin_request(None, list(range(r * tokens, (r + 1) * tokens)))
        cells = store.extend(req)  # [L * Hkv, T]
        for layer in range(layers):
            kv = torch.randn(2, tokens, HKV, D, generator=g).to(DEVICE, torch.bfloat16)
            store.write_kv(layer, store.layer_cells(cells, layer), kv[0], kv[1])
        store.set_precision(req, torch.full((tokens,), int(Precision.INT4), dtype=torch.int8))
        if keep < 1.0:
            store.evict_per_head(req, torch.rand(layers, HKV, tokens, generator=g) < keep)
        reqs.append(req)
    return store, reqs


def batch_index(store: KVStore, reqs, layer: int):
    """Slot map int32 ``[B, Hkv, cap]`` (each (request, KV head)'s live INT4 cells in row
    order, as ``DecodeIndex`` lists them), lengths ``[B, Hkv]`` and the host bound."""
    rows = [r.slot_map.layer_slots(layer) for r in reqs]  # [Hkv, T] each
    live = [[row[h][row[h] != DEAD].sort().values for h in range(HKV)] for row in rows]
    cap = max(int(x.numel()) for per in live for x in per)
    sm = torch.full((len(reqs), HKV, cap), DEAD, dtype=torch.int32)
    lens = torch.zeros(len(reqs), HKV, dtype=torch.int32)
    for b, per in enumerate(live):
        for h, ids in enumerate(per):
            sm[b, h, : ids.numel()] = ids.to(torch.int32)
            lens[b, h] = ids.numel()
    return sm.to(DEVICE), lens.to(DEVICE), SegmentMaxLens(0, cap, 0)


def measure(
    store: KVStore, reqs, q: torch.Tensor, backend: str
) -> tuple[float | None, torch.Tensor]:
    """Kernel µs of one decode call over layer 0 of the batch (None off CUDA) and its output."""
    sm, lens, bound = batch_index(store, reqs, 0)

    def call():
        return decode_attention(
            q,
            store.pool.layers[0],
            sm,
            lens,
            int4_lens=lens,
            max_lens=bound,
            backend=backend,
        )

    out = call()
    return _kernel_us(call), out


def sdpa_us(batch: int, live: int) -> float | None:
    """bf16 SDPA (one query, GQA) over ``live`` dense positions per request."""
    if DEVICE.type != "cuda":
        return None
    q = torch.randn(batch, HQ, 1, D, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, live, D, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = torch.nn.functional.scaled_dot_product_attention
    return _kernel_us(lambda: f(q, k, v, enable_gqa=True))


def density(store: KVStore, reqs) -> float:
    """Mean over (request, column) of how full the 32-cell runs its INT4 cells touch are."""
    vals = []
    for r in reqs:
        s = r.slot_map.slots
        cols = torch.arange(s.shape[0])[:, None].expand_as(s)
        d = store.allocator.int4_run_density(cols[s != DEAD], s[s != DEAD])
        vals.append(d[~d.isnan()])
    return float(torch.cat(vals).mean())


def run_keep(args, keep: float, backend: str) -> dict:
    t0 = time.perf_counter()
    store, reqs = build_store(args.batch, args.tokens, args.layers, keep, args.seed)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed + 1)
    q = torch.randn(args.batch, HQ, D, generator=g).to(DEVICE, torch.bfloat16)
    live = max(int(r.slot_map.layer_slots(0).ne(DEAD).sum(1).max()) for r in reqs)
    row = {"keep": keep, "live_positions": live, "density_before": density(store, reqs)}
    row["sparse_us"], out0 = measure(store, reqs, q, backend)
    used = store.stats().used_bytes
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    moved = 0
    for r in reqs:
        r.int4_thinned = True  # (set by the eviction too; keep=1 evicts nothing)
        moved += store.compact_int4(r, min_density=args.min_density).cells_moved
    row["compact_host_ms"] = (time.perf_counter() - t) * 1e3  # (copies still in flight)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    row["compact_ms"] = (time.perf_counter() - t) * 1e3
    row["compact_ms_per_layer"] = row["compact_ms"] / args.layers
    row["cells_moved"] = moved
    row["host_ns_per_moved_cell"] = row["compact_host_ms"] * 1e6 / moved if moved else None
    assert store.stats().used_bytes == used, "compaction changed resident bytes"
    row["density_after"] = density(store, reqs)
    row["compacted_us"], out1 = measure(store, reqs, q, backend)
    row["rel_err_compacted_vs_sparse"] = _rel(out1.float(), out0.float())
    row["sdpa_us"] = sdpa_us(args.batch, live)
    if row["sparse_us"] and row["compacted_us"] and moved:
        row["speedup"] = row["sparse_us"] / row["compacted_us"]
        gain = row["sparse_us"] - row["compacted_us"]
        # decode steps (one call per layer) after which the move has paid for itself
        row["break_even_steps"] = row["compact_ms_per_layer"] * 1e3 / gain if gain > 0 else None
        if row["sdpa_us"]:
            row["sparse_vs_sdpa"] = row["sdpa_us"] / row["sparse_us"]
            row["compacted_vs_sdpa"] = row["sdpa_us"] / row["compacted_us"]
    row["build_s"] = build_s
    del store, reqs
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cuda = DEVICE.type == "cuda"
    ap.add_argument("--batch", type=int, default=8 if cuda else 2)
    ap.add_argument("--tokens", type=int, default=32768 if cuda else 2048)
    ap.add_argument("--layers", type=int, default=2, help="store layers (time per layer)")
    ap.add_argument("--keep", default="1,0.9,0.75,0.5,0.25", help="fractions of cells kept")
    ap.add_argument("--min-density", type=float, default=0.75, help="compact_int4's threshold")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("int4_compaction.json"))
    args = ap.parse_args()
    backend = "triton" if cuda else "torch"
    rows = []
    print(
        "keep | live | runs full before -> after | sparse µs | compacted µs | speed-up | "
        "vs SDPA before -> after | compaction ms/layer | host ns per moved cell | "
        "break-even steps | rel err"
    )
    for keep in (float(x) for x in args.keep.split(",")):
        r = run_keep(args, keep, backend)
        rows.append(r)
        print(
            f"{keep:.2f} | {r['live_positions']} | {r['density_before']:.2f} -> "
            f"{r['density_after']:.2f} | {_fmt(r['sparse_us'], '.1f')} | "
            f"{_fmt(r['compacted_us'], '.1f')} | {_fmt(r.get('speedup'), '.3f')} | "
            f"{_fmt(r.get('sparse_vs_sdpa'), '.2f')} -> {_fmt(r.get('compacted_vs_sdpa'), '.2f')} | "
            f"{r['compact_ms_per_layer']:.2f} | {_fmt(r['host_ns_per_moved_cell'], '.0f')} | "
            f"{_fmt(r.get('break_even_steps'), '.0f')} | "
            f"{r['rel_err_compacted_vs_sparse']:.1e}",
            flush=True,
        )
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
