"""Session 26's throwaway probe (kept as run): does a head-contiguous INT4 row layout speed
up the Gluon INT4 split? The same programs on the same bytes, as (B requests, Hkv=8, Hq=32)
and as (8B requests, Hkv=1, Hq=4), on rows in a ``decode_attention.slot_order`` layout.
Run on the GPU machine with ``REPO`` set to a checkout and agentkv installed; writes
``$OUT/layout_probe.json``. Superseded by ``decode_splits.py --slots ORDER/head``."""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.environ["REPO"], "benchmarks"))

import int4_slot_runs  # noqa: E402
import torch  # noqa: E402
from decode_attention import _kernel_us, _warm_gpu, slot_order  # noqa: E402

from agentkv.kernels import KVPools, SegmentMaxLens, decode_attention, write_int4  # noqa: E402

D = 128
_churned = functools.lru_cache(maxsize=None)(int4_slot_runs.churned_order)


def case(b: int, n: int, hkv: int, g: int, layout: str, seed: int = 0) -> float:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    tokens = b * n
    pools = KVPools.allocate(2, tokens, 0, hkv, D, device=dev)
    if layout == "churn":  # (one order per pool size: the churn is slow to replay)
        ids = _churned(tokens).to(device=dev, dtype=torch.int32)
    else:
        ids = slot_order(layout, tokens, gen)
    chunk = 1 << 20
    for c in range(0, tokens, chunk):
        m = min(chunk, tokens - c)
        k = torch.randn(m, hkv, D, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(m, hkv, D, device=dev, dtype=torch.bfloat16, generator=gen)
        write_int4(pools.int4, ids[c : c + m], k, v)
    q = torch.randn(b, hkv * g, D, device=dev, dtype=torch.bfloat16, generator=gen)
    sm = (ids + pools.int4_base).view(b, n).contiguous()
    seq = torch.full((b,), n, device=dev, dtype=torch.int32)
    lens = SegmentMaxLens(0, n, 0)

    def fn() -> torch.Tensor:
        return decode_attention(q, pools, sm, seq, int4_lens=seq, max_lens=lens)

    fn()
    torch.cuda.synchronize()
    _warm_gpu(0.2)
    return _kernel_us(fn)


out = []
for b, n in [(8, 32768), (32, 4096), (1, 32768)]:
    for rnd in range(2):
        for hkv, g, bb in [(8, 4, b), (1, 4, b * 8)]:
            for layout in ("sequential", "churn", "runs:16", "runs:32", "runs:64"):
                if hkv == 8 and layout.startswith("runs") and layout != "runs:32":
                    continue
                us = case(bb, n, hkv, g, layout)
                torch.cuda.empty_cache()
                row = dict(B=b, N=n, hkv=hkv, batch=bb, layout=layout, round=rnd, kernel_us=us)
                print(json.dumps(row), flush=True)
                out.append(row)
with open(os.path.join(os.environ["OUT"], "layout_probe.json"), "w") as f:
    json.dump(out, f, indent=1)
