"""Full-precision K and V rows written into their pool cells in one kernel.

Each (token, KV head) row of a layer's new K and V goes to that head's cell in the
full-precision pool (:class:`~.pools.FullPool`, ``[num_slots, Hkv, D]``). Indexed assignment
is one scatter kernel for K and one for V (~2.4 us each at batch-1 decode on an H200, in a
CUDA graph); :func:`write_full` stores both in one launch, one program per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .pools import FullPool
from .rounding import round_to


def write_full_ref(pool: FullPool, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Torch reference: ``pool.k[cells[h, t], h] = k[t, h]`` (and V) for every token ``t`` and
    head ``h``; ``cells`` int64 ``[Hkv, n]``, ``k``/``v`` ``[n, Hkv, D]`` (cast to the pool's
    dtype)."""
    idx = cells.to(pool.k.device, torch.int64).t()
    heads = torch.arange(cells.shape[0], device=pool.k.device)
    pool.k[idx, heads] = k.to(pool.k.device, pool.k.dtype)
    pool.v[idx, heads] = v.to(pool.v.device, pool.v.dtype)


@triton.jit
def _write_full_kernel(
    k_ptr,
    v_ptr,
    cells_ptr,
    pk_ptr,
    pv_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ch,
    stride_ct,
    stride_ps,
    stride_ph,
    stride_vs,
    stride_vph,
    H,
    D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)[None, :]
    hmask = heads < H
    mask = hmask[:, None] & (cols < D)
    cell = tl.load(cells_ptr + heads * stride_ch + t * stride_ct, mask=hmask, other=0)
    h = heads[:, None].to(tl.int64)
    c = cell[:, None].to(tl.int64)
    dt = pk_ptr.dtype.element_ty
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + cols, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=mask).to(tl.float32)
    # (a wider input rounded to the pool's dtype as torch casts it; the same dtype: as is)
    tl.store(pk_ptr + c * stride_ps + h * stride_ph + cols, round_to(k, dt).to(dt), mask=mask)
    tl.store(pv_ptr + c * stride_vs + h * stride_vph + cols, round_to(v, dt).to(dt), mask=mask)


def write_full(
    pool: FullPool, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: Backend = "auto"
) -> None:
    """:func:`write_full_ref` in one kernel: ``cells`` int64 ``[Hkv, n]`` on the pool's
    device (never DEAD), ``k``/``v`` ``[n, Hkv, D]`` with unit stride over ``D`` (any other
    strides), any float dtype (stored in the pool's)."""
    h, n = cells.shape
    D = pool.k.shape[-1]
    if tuple(k.shape) != (n, h, D) or k.shape != v.shape:
        raise ValueError(f"k and v must be [{n}, {h}, {D}], got {list(k.shape)} / {list(v.shape)}")
    if resolve_backend(backend, pool.k.device) == "torch":
        return write_full_ref(pool, cells, k, v)
    if n == 0:
        return None
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    cells = cells.to(pool.k.device, torch.int64)
    _write_full_kernel[(n,)](
        k, v, cells, pool.k, pool.v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cells.stride(0), cells.stride(1),
        pool.k.stride(0), pool.k.stride(1), pool.v.stride(0), pool.v.stride(1),
        h, D,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if h * D <= 1024 else 4,
    )  # fmt: skip
    return None
