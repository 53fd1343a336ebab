"""What the INT4 pool's row layout costs the decode kernel: the same rows, laid out four ways.

The INT4 pool stores one 64-byte row of codes (plus its scales) per (token slot, KV head),
rows ``slot * Hkv + head``: a KV head's consecutive tokens are ``Hkv`` rows apart even when
their slots are consecutive. This times ``decode_attention`` (INT4 and INT2, CUDA graph, L2
flushed) over the same number of rows (B=8 requests x N positions x 8 KV heads, Hq/Hkv=4,
D=128) with

- ``heads interleaved, scattered slots``: the benchmark's usual layout (``decode_attention.py``);
- ``heads interleaved, consecutive slots``: each request on consecutive slots;
- ``per-head rows, scattered``: each KV head its own pool rows (emulated with Hkv=1 pools and
  8x the requests: the kernel then reads a head's rows at ``slot``), token slots scattered;
- ``per-head rows, consecutive``: the same with consecutive slots: every program reads one
  contiguous run of rows, the most a page-contiguous layout could give.

INT2 pages are already per (page, head) contiguous; its ``scattered`` / ``consecutive`` is the
order of the pages. Run on the GPU machine::

    python3 benchmarks/decode_layout.py --tokens 32768 --out $OUT/decode_layout.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention import _kernel_us, _warm_gpu  # noqa: E402

from agentkv.kernels import (  # noqa: E402
    KVPools,
    SegmentMaxLens,
    decode_attention,
    write_int2_pages,
    write_int4,
)

D, GROUP, HEADS, BATCH = 128, 4, 8, 8


def _layout(n: int, hkv: int, b: int, scatter: bool, seed: int = 0) -> dict:
    """Pools and inputs for ``b`` requests of ``n`` positions over ``hkv`` KV heads."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    tokens = b * n
    pools = KVPools.allocate(1, tokens, tokens // 32, hkv, D, device=dev)
    ids = torch.randperm(tokens, device=dev, generator=g).int()
    pages = torch.randperm(tokens // 32, device=dev, generator=g).int()
    if not scatter:
        ids = torch.arange(tokens, device=dev, dtype=torch.int32)
        pages = torch.arange(tokens // 32, device=dev, dtype=torch.int32)
    chunk = 1 << 20  # rows written per call
    for s in range(0, tokens, chunk):
        e = min(tokens, s + chunk)
        k = torch.randn(e - s, hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(e - s, hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        write_int4(pools.int4, ids[s:e], k, v)
        write_int2_pages(pools.int2, pages[s // 32 : e // 32], k, v)
    q = torch.randn(b, hkv * GROUP, D, device=dev, dtype=torch.bfloat16, generator=g)
    full = torch.full((b,), n, device=dev, dtype=torch.int32)
    return {
        "q": q,
        "pools": pools,
        "seq": full,
        "int4": (ids + pools.int4_base).view(b, n),
        "int2": pools.int2_slot_ids(pages).reshape(b, n).int(),
    }


def _time(lay: dict, impl: str, n: int) -> float | None:
    kw = dict(slot_map=lay[impl].contiguous(), seq_lens=lay["seq"])
    if impl == "int4":
        kw.update(int4_lens=lay["seq"], max_lens=SegmentMaxLens(0, n, 0))
    else:
        kw.update(int2_lens=lay["seq"], max_lens=SegmentMaxLens(n, 0, 0))
    return _kernel_us(lambda: decode_attention(lay["q"], lay["pools"], **kw))


def _sdpa_us(n: int) -> float | None:
    """bf16 SDPA's kernel time over the same K/V (B=8, Hkv=8, N positions)."""
    q = torch.randn(BATCH, HEADS * GROUP, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(BATCH, HEADS, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return _kernel_us(lambda: sdpa(q, k, v, enable_gqa=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768, help="positions per request (N)")
    ap.add_argument("--out", type=Path, default=Path("decode_layout.json"))
    args = ap.parse_args()
    n = args.tokens
    sdpa = _sdpa_us(n)
    rows = []
    cases = [
        ("heads interleaved, scattered slots", HEADS, BATCH, True),
        ("heads interleaved, consecutive slots", HEADS, BATCH, False),
        ("per-head rows, scattered", 1, BATCH * HEADS, True),
        ("per-head rows, consecutive", 1, BATCH * HEADS, False),
    ]
    for name, hkv, b, scatter in cases:
        lay = _layout(n, hkv, b, scatter)
        _warm_gpu(1.0)
        for impl in ("int4", "int2"):
            us = _time(lay, impl, n)
            row = {"layout": name, "impl": impl, "N": n, "kernel_us": us, "sdpa_us": sdpa}
            row["vs_sdpa"] = sdpa / us if us and sdpa else None
            rows.append(row)
            print(json.dumps(row), flush=True)
        del lay
        torch.cuda.empty_cache()
    shape = dict(B=BATCH, Hkv=HEADS, G=GROUP, D=D)
    args.out.write_text(json.dumps({"shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
