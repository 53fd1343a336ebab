"""Masked SDPA on the GPU: time of the first and second call per new shape, per backend set.

Why the engine's attention excludes cuDNN (docs/benchmarks.md §6d): with a boolean mask,
torch picks cuDNN attention on an H100, which builds a graph for every new (queries, keys)
shape. GPU only; not a test::

    python benchmarks/sdpa_mask_backends.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(300, 3300), (301, 3301), (317, 3290), (64, 3400), (65, 3401)]  # (queries, keys)
BACKENDS = {
    "default": None,
    "no-cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn-only": [SDPBackend.CUDNN_ATTENTION],
}


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) * 1e3, 2)


def main() -> None:
    dev = "cuda"
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    for label, backends in BACKENDS.items():
        for per_head in (False, True):
            times = []
            for n, m in SHAPES:  # 3 KV heads, GQA group 3 folded into the query rows
                q = torch.randn(1, 3, 3 * n, 64, device=dev, dtype=torch.bfloat16)
                k = torch.randn(1, 3, m, 64, device=dev, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                mask = torch.rand(1, 3 if per_head else 1, 3 * n, m, device=dev) < 0.7

                def go(q=q, k=k, v=v, mask=mask, backends=backends):
                    if backends is None:
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    with sdpa_kernel(backends):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

                times.append((_ms(go), _ms(go)))
            kind = "per-head mask" if per_head else "shared mask"
            print(f"{label:10} {kind:13} first/second ms per new shape: {times}", flush=True)


if __name__ == "__main__":
    main()
