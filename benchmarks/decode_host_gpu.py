"""Host (CPU) time of one ``decode_attention`` call on a GPU machine, per impl.

    python benchmarks/decode_host_gpu.py                        # B=8 and B=1, N=4k
    python benchmarks/decode_host_gpu.py --config '{"direct_launch": false}' --profile
    PYTHONPATH=/tmp/old_agentkv python benchmarks/decode_host_gpu.py   # another checkout

For each shape it prints, per impl (and SDPA on the same K/V as the anchor), the median and
the fastest of ``--loops`` loops of ``--calls`` back-to-back calls (CPU clock, the GPU
synchronized before and after each loop: host time per call where the host is slower
than the kernels, as at these shapes) and the same with every kernel launch stubbed
(``python``: the Python part). ``--profile``: cProfile of 300 calls per impl at the first
shape, top functions by own time. The pools and inputs are ``decode_attention.py``'s
(``Shape``, random slot layout). What it measures is the host, which on a shared machine
is noisy: compare builds side by side in one run, by their ratio to SDPA's host time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_attention as bench  # noqa: E402

from agentkv.kernels import DecodeConfig  # noqa: E402


def per_call_us(fn, calls: int, loops: int) -> tuple[float, float]:
    """(median, fastest) over ``loops`` loops of ``calls`` calls, µs per call."""
    times = []
    for _ in range(loops):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        times.append((t1 - t) / calls * 1e6)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--impls", default="int4,mixed,int2,bf16,tiered")
    ap.add_argument("--config", default="{}", help="JSON DecodeConfig kwargs")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    cfg = DecodeConfig(**json.loads(args.config))
    print(f"torch {torch.__version__} config {args.config} {torch.cuda.get_device_name()}")
    for i, b in enumerate(int(x) for x in args.batches.split(",")):
        s = bench.Shape(b, args.length)
        sdpa = bench._sdpa(s)
        for _ in range(20):
            sdpa()
        med, best = per_call_us(sdpa, args.calls, args.loops)
        print(f"B={b} N={args.length} sdpa host median {med:.1f} min {best:.1f}")
        for impl in args.impls.split(","):
            fn = bench._ours(s, impl, False, cfg)
            stub = bench._ours_no_launch(s, impl, False, cfg)
            for _ in range(20):
                fn()
                stub()
            med, best = per_call_us(fn, args.calls, args.loops)
            pmed, pbest = per_call_us(stub, args.calls, args.loops)
            print(
                f"B={b} N={args.length} {impl}: host median {med:.1f} min {best:.1f}; "
                f"python median {pmed:.1f} min {pbest:.1f}",
                flush=True,
            )
            if args.profile and i == 0:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(300):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue())


if __name__ == "__main__":
    main()
