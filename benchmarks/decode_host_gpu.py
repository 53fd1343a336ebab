"""Host (CPU) time of one ``decode_attention`` call on a GPU machine, per impl.

    python benchmarks/decode_host_gpu.py                        # B=8 and B=1, N=4k
    python benchmarks/decode_host_gpu.py --config '{"direct_launch": false}' --profile
    PYTHONPATH=/tmp/old_agentkv python benchmarks/decode_host_gpu.py   # another checkout

For each shape it prints, per impl (and SDPA on the same K/V as the anchor), what
``decode_attention.py``'s host probe measures (:func:`decode_attention._host_probe`): the
host time per call over three loops of ``--calls`` back-to-back calls (median and fastest
loop; host time per call where the host is slower than the kernels, as at these shapes)
and ``python``, the fastest loop with every kernel launch stubbed (the Python part).
``--profile``: cProfile of 300 calls per impl at the first shape, top functions by own
time. The pools and inputs are ``decode_attention.py``'s (``Shape``, random slot layout).
What it measures is the host, which on a shared machine is noisy: compare builds side by
side in one run, by their ratio to SDPA's host time. (Session 29's tables came from its
first version, five loops of its own timing; the probe is the same measurement.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_attention as bench  # noqa: E402

from agentkv.kernels import DecodeConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8,1")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--impls", default="int4,mixed,int2,bf16,tiered")
    ap.add_argument("--config", default="{}", help="JSON DecodeConfig kwargs")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_host_gpu.py times a GPU machine's host: it needs CUDA")
    cfg = DecodeConfig(**json.loads(args.config))
    print(f"torch {torch.__version__} config {args.config} {torch.cuda.get_device_name()}")
    for i, b in enumerate(int(x) for x in args.batches.split(",")):
        s = bench.Shape(b, args.length)
        sdpa = bench._sdpa(s)
        for _ in range(20):
            sdpa()
        r = bench._host_probe(sdpa, args.calls)
        print(
            f"B={b} N={args.length} sdpa host median {r['host_us']:.1f} min {r['host_us_min']:.1f}"
        )
        for impl in args.impls.split(","):
            fn = bench._ours(s, impl, False, cfg)
            stub = bench._ours_no_launch(s, impl, False, cfg)
            for _ in range(20):
                fn()
                stub()
            r = bench._host_probe(fn, args.calls, no_launch_fn=stub)
            print(
                f"B={b} N={args.length} {impl}: host median {r['host_us']:.1f} min "
                f"{r['host_us_min']:.1f}; python {r['python_us']:.1f}",
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
