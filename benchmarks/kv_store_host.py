"""Host time of the KV store's moves at a model's shape: what a demotion, a decode-time page,
an eviction and a compaction cost per cell in the store's bookkeeping (maps, counts, free
lists on the CPU) plus their copies and quantization on the device.

One request of ``--tokens`` positions in a :class:`~agentkv.cache.KVStore` of the model's
shape (``--shape L,Hkv,D``, ``--kv-slots`` cells per column; K/V written at random) is:

1. demoted to INT4 but for its last ``32 * --pages`` positions (``set_precision``, one call:
   a prefill plan's quantization);
2. demoted one 32-position page at a time over those (the engine's decode-time pages,
   ``Engine._demote_tail``), each timed, with the kernels' ``DecodeIndex`` following each
   page in place (``DecodeIndex.advance``, as ``KernelDecode.rebuild`` does; timed), then
   built anew on the device (the rebuild it saves; checked against the CPU's and against
   the followed one);
3. thinned by per-(layer, KV head) eviction keeping half of the cells (``evict_per_head``);
4. compacted (``compact_int4``, min density 0.75), where the store has it.

Times are wall clock with the device synchronized (ms, and ns per cell moved)::

    python3 benchmarks/kv_store_host.py --shape 36,8,128 --kv-slots 131072 --tokens 8192 \\
        --device cuda --out kv_store_host.json

Run it against another checkout's package (``PYTHONPATH=/old/checkout``) with ``--label``
to compare.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from agentkv.cache import DecodeIndex, KVStore, Precision


def _timed(device: torch.device, fn, *args):
    """``(seconds, fn(*args))``, the device's work included."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def _same_cells(a: DecodeIndex, b: DecodeIndex) -> bool:
    """Equal lengths, and per column the same cells in each segment (an index followed in
    place lists a page's INT4 cells in position order, a rebuild in row order)."""
    if not all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in ("seq_lens", "int2_lens", "int4_lens")
    ):
        return False

    def cells(ix: DecodeIndex) -> torch.Tensor:  # per column, (segment, cell) keys sorted
        n = int(ix.seq_lens.max())
        m = ix.slot_map[:, :, :n].long()
        at = torch.arange(n, device=m.device)
        n2, n4 = ix.int2_lens[..., None], (ix.int2_lens + ix.int4_lens)[..., None]
        seg = (at >= n2).long() + (at >= n4).long() + (at >= ix.seq_lens[..., None]).long()
        return torch.sort(seg * (1 << 40) + m, dim=-1).values

    return torch.equal(cells(a), cells(b))


def run(args) -> dict:
    device = torch.device(args.device)
    layers, heads, dim = (int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(args.seed)
    st = KVStore(layers, heads, dim, args.kv_slots, dtype=torch.bfloat16, device=device)
    req = st.begin_request(None, list(range(args.tokens)))
    cells = st.extend(req)
    for layer in range(layers):
        kv = torch.randn(2, args.tokens, heads, dim, generator=g).to(device, torch.bfloat16)
        st.write_kv(layer, st.layer_cells(cells, layer), kv[0], kv[1])
    columns = layers * heads
    bulk = args.tokens - 32 * args.pages
    prec = torch.full((bulk,), int(Precision.INT4), dtype=torch.int8)
    s, _ = _timed(device, st.set_precision, req, prec)
    row = {"demote_ms": s * 1e3, "demote_ns_per_cell": s * 1e9 / (bulk * columns)}
    pages, advances = [], []
    windowed = "start" in inspect.signature(st.set_precision).parameters
    # the kernels' index before the pages, followed in place after each where the package
    # can (KernelDecode.rebuild with the page: DecodeIndex.advance)
    followed = DecodeIndex.build(req.slot_map, st.layout, 256, device)
    follows = hasattr(followed, "advance")
    for p in range(args.pages):
        end = bulk + 32 * (p + 1)
        if windowed:  # as Engine._demote_tail calls it: the page's 32 positions only
            page = torch.full((32,), int(Precision.INT4), dtype=torch.int8)
            s, _ = _timed(device, st.set_precision, req, page, "int4", end - 32)
        else:  # (a package from before session 32: every position, FULL before the page)
            prec = torch.full((end,), int(Precision.FULL), dtype=torch.int8)
            prec[end - 32 :] = int(Precision.INT4)
            s, _ = _timed(device, st.set_precision, req, prec)
        pages.append(s * 1e3)
        if follows:
            s, ok = _timed(device, followed.advance, req.slot_map, st.layout, end - 32, end)
            advances.append(s * 1e3 if ok else None)
    row["page_ms"] = pages
    row["page_ms_median"] = statistics.median(pages)
    if follows:
        row["index_advance_ms"] = advances
        done = [a for a in advances if a is not None]
        row["index_advance_ms_median"] = statistics.median(done) if done else None
    # the kernels' decode index, rebuilt after every page (KernelDecode.rebuild)
    builds = []
    for _ in range(3):
        s, index = _timed(device, DecodeIndex.build, req.slot_map, st.layout, 256, device)
        builds.append(s * 1e3)
    row["index_build_ms"] = statistics.median(builds)
    if follows:  # the index followed page by page holds what a rebuild holds
        row["index_advance_matches_build"] = _same_cells(followed, index)
    if device.type != "cpu":  # the same index as built on the CPU
        ref = DecodeIndex.build(req.slot_map, st.layout, 256, "cpu")
        row["index_matches_cpu"] = all(
            torch.equal(getattr(index, f).cpu(), getattr(ref, f))
            for f in ("slot_map", "seq_lens", "int2_lens", "int4_lens")
        ) and (index.max_lens, index.longest) == (ref.max_lens, ref.longest)
    keep = torch.rand(layers, heads, args.tokens, generator=g) < 0.5
    s, res = _timed(device, st.evict_per_head, req, keep)
    row["evict_ms"] = s * 1e3
    row["evict_ns_per_evicted_cell"] = s * 1e9 / max(res.entries_evicted, 1)
    if hasattr(st, "compact_int4"):
        s, res = _timed(device, st.compact_int4, req, 0.75)
        row["compact_ms"] = s * 1e3
        row["cells_moved"] = res.cells_moved
        row["compact_ns_per_moved_cell"] = s * 1e9 / res.cells_moved if res.cells_moved else None
    st.finish_request(req, cache=False)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="30,3,64", help="layers,KV heads,head dim (SmolLM2)")
    ap.add_argument("--kv-slots", type=int, default=32768, help="cells per column")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--pages", type=int, default=8, help="decode-time pages of 32 timed")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", type=Path, default=Path("kv_store_host.json"))  # (no commas)
    args = ap.parse_args()
    row = run(args)
    row.update(
        label=args.label,
        shape=args.shape,
        kv_slots=args.kv_slots,
        tokens=args.tokens,
        device=str(args.device),
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    print(
        f"{args.label} | {args.shape} | {args.kv_slots} | demote {row['demote_ns_per_cell']:.0f} "
        f"ns/cell | page {row['page_ms_median']:.1f} ms | index "
        f"{row['index_build_ms']:.1f} ms ({row.get('index_matches_cpu', '-')}), followed "
        f"{row.get('index_advance_ms_median') or 0:.2f} ms "
        f"({row.get('index_advance_matches_build', '-')}) | evict "
        f"{row['evict_ns_per_evicted_cell']:.0f} ns/cell | compact "
        + (
            f"{row['compact_ns_per_moved_cell']:.0f} ns/moved cell"
            if row.get("compact_ns_per_moved_cell")
            else "-"
        )
    )
    args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
