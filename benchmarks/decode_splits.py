"""How the decode kernels' time and error depend on the split plan and the launch order.

Run on the GPU machine::

    python3 benchmarks/decode_splits.py --shapes '8,131072;32,32768' --impls int4 \\
        --variants 'default={};split-fastest={"heads_fastest": false}' --out $OUT/splits.json

For every shape (B, N; Hq 32, Hkv 8, D 128, every position live, token slots scattered as in
``decode_attention.py``), impl and variant (``DecodeConfig`` keyword arguments as JSON), it
records (``--slots``: where the tokens' rows lie in the full and INT4 pools, one or several
layouts measured side by side, e.g. ``random,sequential,runs:32,churn`` to see what scattered
rows cost and what the allocator's free lists give after a churn, ``/head`` appended for an
INT4 pool whose rows lie head-major, e.g. ``runs:32/head``; ``--separate-scales``:
the INT4 scales and zeros as four tensors instead of the pool's interleaved buffer;
``--dead random,runs``: with 50% of the positions DEAD too, as ``decode_attention.py``'s
DEAD tables):

- ``kernel_us``: the whole call (split kernel + merge) from a CUDA graph, L2 flushed, and its
  ratio to SDPA's on the same shape;
- ``split_us`` / ``merge_us``: each kernel's own time (torch profiler, mean of 10 calls, L2
  flushed before each); with ``pdl`` (the default on Hopper) the merge starts while the
  splits run and waits for them in-kernel, so its ``merge_us`` includes that wait: compare
  ``kernel_us``;
- ``rel_err_vs_ref`` / ``rel_err_fp16_vs_ref`` and their floors: the error against the
  float32 torch reference on the same quantized values with a bf16 and an fp16 query
  (``decode_attention.py``'s ``_ref_errors``; the fp16 output's rounding floor is 8x lower,
  so the kernel's own error shows there).

At the end it prints (and writes next to ``--out`` as ``.md``) a table of each variant's
median ``kernel_us`` over its rounds, its spread, and its ratio to the first variant's and to
SDPA's (:func:`summary`). One process's A/A spread (the same launch under two names) was ±5%
on the H200 (session 24): run ``--rounds 2`` or more and read the direction over repeats.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention import (  # noqa: E402
    LAUNCHED_KERNELS,
    DecodeConfig,
    Shape,
    _flush_buffer,
    _kernel_us,
    _ours,
    _ref_errors,
    _sdpa,
    _warm_gpu,
)


def kernel_means(fn, calls: int = 10) -> dict[str, float]:
    """Mean device time per call of each decode kernel (the splits, the merge), microseconds."""
    flush = _flush_buffer()
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    out = dict.fromkeys(LAUNCHED_KERNELS, 0.0)
    for ev in prof.events():
        for k in LAUNCHED_KERNELS:
            if k in ev.name:
                out[k] += ev.device_time / calls
    return out


def measure(s: Shape, impl: str, cfg: DecodeConfig, sdpa_us: float, dead: str = "none") -> dict:
    """One variant's times and errors; ``dead``: "none", or the pattern of 50% DEAD
    positions ("random" or "runs", :meth:`Shape.use_dead_pattern`)."""
    on = dead != "none"
    if on:
        s.use_dead_pattern(dead)
    fn = _ours(s, impl, on, cfg)
    errs = _ref_errors(s, impl, on, fn(), _ours(s, impl, on, cfg, s.q.half())())
    _warm_gpu(0.1)
    us = _kernel_us(fn)
    per = kernel_means(fn)
    gluon = sum(per[k] for k in per if "gluon" in k)
    return {
        "kernel_us": us,
        "vs_sdpa": sdpa_us / us if us else None,
        # the Triton and the Gluon splits
        "split_us": per["_decode_split_kernel"] + gluon,
        "gluon_split_us": gluon,
        "merge_us": per["_merge_splits_kernel"],
        **errs,
    }


def summary(rows: list[dict]) -> str:
    """A markdown table of the sweep: per shape and impl, each variant's ``kernel_us`` over
    its rounds (median, min-max) and its median's ratio to the first variant's (the
    baseline of an A/B), then its ratio to SDPA. Rows with an error show it instead."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        name = r["variant"] + (f" @{r['slots']}" if r.get("slots", "random") != "random" else "")
        name += f" dead:{r['dead']}" if r.get("dead", "none") != "none" else ""
        groups.setdefault((r["B"], r["N"], r["impl"]), {}).setdefault(name, []).append(r)
    lines = [
        "| B | N | impl | variant | kernel µs (median) | min-max | vs first | vs SDPA | rounds |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for (b, n, impl), variants in groups.items():
        base = None
        for name, rs in variants.items():
            ok = [r for r in rs if r.get("kernel_us")]
            if not ok:
                err = next((r["error"] for r in rs if "error" in r), "no time")
                lines.append(f"| {b} | {n} | {impl} | {name} | {err} | | | | {len(rs)} |")
                continue
            us = statistics.median(r["kernel_us"] for r in ok)
            sdpa = statistics.median(r["kernel_us"] * r["vs_sdpa"] for r in ok)
            base = us if base is None else base
            spread = f"{min(r['kernel_us'] for r in ok):.1f}-{max(r['kernel_us'] for r in ok):.1f}"
            lines.append(
                f"| {b} | {n} | {impl} | {name} | {us:.1f} | {spread} | "
                f"{us / base - 1:+.1%} | {sdpa / us:.2f}x | {len(ok)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,131072;32,32768;8,32768", help="B,N;B,N;...")
    ap.add_argument(
        "--impls",
        default="int4",
        help="of int4, int2, mixed (3/4 INT2, then INT4), tiered (mixed, its last 512 in bf16)",
    )
    ap.add_argument(
        "--variants",
        default='default={};uncapped={"max_split_len_folded": 0}',
        help="name=JSON DecodeConfig kwargs;...",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="times every variant is measured, in turn"
    )
    ap.add_argument(
        "--slots",
        default="random",
        help="comma-separated token-slot layouts of the full and INT4 pools, each measured in "
        "every round: random, sequential, runs:E, churn, live (decode_attention.slot_order); "
        "'/head' appended (e.g. churn/head): the INT4 pool head-major",
    )
    ap.add_argument(
        "--sequential-slots",
        action="store_true",
        help="the same as --slots sequential",
    )
    ap.add_argument(
        "--separate-scales",
        action="store_true",
        help="the INT4 scales and zeros as four tensors (the pool interleaves them by default)",
    )
    ap.add_argument(
        "--dead",
        default="none",
        help="comma-separated, each measured in every round: none (every position live), "
        "random or runs (50%% of the positions DEAD, as decode_attention.py's DEAD tables)",
    )
    ap.add_argument("--out", type=Path, default=Path("decode_splits.json"))
    args = ap.parse_args()
    deads = args.dead.split(",")
    if set(deads) - {"none", "random", "runs"}:
        raise SystemExit(f"--dead takes none, random, runs; got {args.dead!r}")
    variants = {}
    for spec in filter(None, args.variants.split(";")):
        name, _, kwargs = spec.partition("=")
        variants[name] = json.loads(kwargs or "{}")
    layouts = ["sequential"] if args.sequential_slots else args.slots.split(",")
    rows = []
    for spec in args.shapes.split(";"):
        b, n = (int(x) for x in spec.split(","))
        shapes = {}
        for lay in layouts:
            shapes[lay] = Shape(b, n, slots=lay, separate_scales=args.separate_scales)
            if len(shapes) == 1:
                _warm_gpu(1.0)
                sdpa_us = _kernel_us(_sdpa(shapes[lay]))
            shapes[lay].drop_sdpa_kv()
        print(f"B={b} N={n}: SDPA {sdpa_us} us", flush=True)
        for rnd, impl, lay, dead, (name, kw) in itertools.product(
            range(args.rounds), args.impls.split(","), layouts, deads, variants.items()
        ):
            row = {"B": b, "N": n, "impl": impl, "variant": name, "slots": lay, "round": rnd}
            row["dead"] = dead
            try:
                cfg = DecodeConfig(**kw)
                row.update(measure(shapes[lay], impl, cfg, sdpa_us, dead))
                row["config"] = asdict(cfg)
            except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            shown = {k: v for k, v in row.items() if k != "config"}
            print(json.dumps(shown, default=lambda x: round(x, 6)), flush=True)
        del shapes
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"sdpa": "torch SDPA bf16", "rows": rows}, indent=1))
    table = summary(rows)
    args.out.with_suffix(".md").write_text(table)
    print(table, flush=True)


if __name__ == "__main__":
    main()
