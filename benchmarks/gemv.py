"""Batch-1 GEMVs at a model's projection shapes: cuBLAS (``F.linear``) against a plain Triton
GEMV (a prototype here, :func:`gemv`: row blocks of ``W``, float32 elementwise accumulation,
one sum at the end) over a sweep of its tiles, kernel time with L2 flushed
(``triton.testing.do_bench``), bytes read / time as TB/s, and the error against float64.
Whether a GEMV of our own is worth the engine's decode step (docs/benchmarks.md §3, session
35: not yet).

    python3 benchmarks/gemv.py --shapes '6144,4096;4096,4096;28672,4096;4096,14336' --out gemv.json

``--shapes`` are ``N,K`` pairs (``weight [N, K]``: the stacked q/k/v, o, stacked gate/up and
down projections of an 8B model by default, then SmolLM2's).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from agentkv.kernels.rounding import round_to

DEFAULT_SHAPES = (
    "6144,4096;4096,4096;28672,4096;4096,14336;128256,4096;960,576;576,576;3072,576;576,1536"
)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """A program's tile (``block_n`` rows, ``block_k`` columns a step), warps and stages."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows64 = tl.where(rmask, rows, 0).to(tl.int64)  # (in range: no row mask on the loads)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows64[:, None] * stride_wn + cols[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptr + cols)
        else:
            cmask = cols < K
            w = tl.load(w_ptrs, mask=cmask[None, :], other=0.0)
            xv = tl.load(x_ptr + cols, mask=cmask, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + rows, round_to(y, dt).to(dt), mask=rmask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in one kernel: ``x [..., K]`` with one row (any leading dims of size
    1), ``weight [N, K]`` with unit stride over ``K``, ``bias [N]`` or None, one dtype ->
    ``[..., N]`` in that dtype. Summed in float32 in another order than cuBLAS's: results
    may differ from ``F.linear`` in the last bits."""
    K = x.shape[-1]
    if x.numel() != K:
        raise ValueError(f"gemv takes one row, got x of shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [N, {K}] with unit stride over K, got {tuple(weight.shape)}"
        )
    N = weight.shape[0]
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
    cfg = config or GemvConfig()
    row = x.reshape(K)
    if row.stride(0) != 1:
        row = row.contiguous()
    y = torch.empty(N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        row, weight, bias if bias is not None else y, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y.view(*x.shape[:-1], N)


def bench_shape(N: int, K: int, configs: list, dev: torch.device) -> dict:
    """cuBLAS and the best of ``configs`` for ``weight [N, K]`` (bf16, random)."""
    from triton.testing import do_bench

    g = torch.Generator(device=dev).manual_seed(N + K)
    w = (torch.randn(N, K, generator=g, device=dev) / K**0.5).to(torch.bfloat16)
    x = torch.randn(1, 1, K, generator=g, device=dev).to(torch.bfloat16)
    exact = (w.double() @ x.reshape(K).double()).float()
    nbytes = w.numel() * 2 + K * 2 + N * 2
    t_ref = do_bench(lambda: F.linear(x, w), warmup=25, rep=100)
    err_ref = float((F.linear(x, w).reshape(N).float() - exact).abs().max())
    best = None
    for cfg in configs:
        if cfg.block_k > max(64, 1 << (K - 1).bit_length()):
            continue
        try:
            t = do_bench(lambda cfg=cfg: gemv(x, w, config=cfg), warmup=10, rep=40)
        except Exception as e:  # (a tile too large for the registers or shared memory)
            print(f"skip {cfg}: {type(e).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    _, cfg = best
    t = do_bench(lambda: gemv(x, w, config=cfg), warmup=25, rep=100)  # (as the reference)
    err = float((gemv(x, w, config=cfg).reshape(N).float() - exact).abs().max())
    return {
        "N": N, "K": K, "mbytes": nbytes / 1e6,
        "cublas_us": t_ref * 1e3, "cublas_tbps": nbytes / t_ref / 1e9,
        "triton_us": t * 1e3, "triton_tbps": nbytes / t / 1e9,
        "speedup": t_ref / t, "config": dataclasses.asdict(cfg),
        "err_cublas": err_ref, "err_triton": err,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--block-n", default="4,8,16,32")
    ap.add_argument("--block-k", default="256,512,1024")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--out", type=Path, default=Path("gemv.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    configs = [
        GemvConfig(bn, bk, w, s)
        for bn, bk, w, s in itertools.product(
            ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages)
        )
    ]
    rows = []
    for shape in args.shapes.split(";"):
        N, K = (int(v) for v in shape.split(","))
        row = bench_shape(N, K, configs, dev)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        rows.append(row)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
