"""INT2 KV quantization into pages of 32 tokens: keys per channel over the page, values per
token in groups of 32 channels.

``write_int2_pages`` quantizes whole pages (tokens that do not fill a page belong in the
INT4 pool) and writes them into given pages of an :class:`~.pools.Int2Pool`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .asymmetric_quant import (
    asym_codes,
    asym_codes_tl,
    asym_dequant,
    asym_params,
    asym_params_tl,
)
from .backend import Backend, resolve_backend
from .packing import pack_int2, pack_int2_u8, unpack_int2
from .pools import INT2_PAGE, Int2Pool
from .quant_token_groups import (
    dequantize_token_groups_ref,
    launch_quantize_token_groups,
    quantize_token_groups_ref,
)


def quantize_int2_keys_ref(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference. k: [P, 32, Hkv, D] float (32 token rows per page) ->
    (codes [P, Hkv, 32, D/4] uint8, scale [P, Hkv, D] fp16, zero [P, Hkv, D] fp16)."""
    x = k.float().permute(0, 2, 1, 3)  # [P, H, 32, D]
    scale, zero = asym_params(x.amin(2), x.amax(2), 3)
    codes = asym_codes(x, scale[:, :, None, :], zero[:, :, None, :], 3)
    return pack_int2(codes), scale, zero


def dequantize_int2_keys_ref(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """Torch reference. (codes [P, Hkv, 32, D/4], scale / zero [P, Hkv, D]) ->
    [P, Hkv, 32, D] float32."""
    return asym_dequant(unpack_int2(codes), scale[:, :, None, :], zero[:, :, None, :])


def quantize_int2_values_ref(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference. v: [P, 32, Hkv, D] float -> (codes [P, Hkv, 32, D/4] uint8,
    scale [P, Hkv, 32, D/32] fp16, zero [P, Hkv, 32, D/32] fp16)."""
    return quantize_token_groups_ref(v.permute(0, 2, 1, 3), 2)


def dequantize_int2_values_ref(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """Torch reference. (codes [P, Hkv, 32, D/4], scale / zero [P, Hkv, 32, D/32]) ->
    [P, Hkv, 32, D] float32."""
    return dequantize_token_groups_ref(codes, scale, zero, 2)


def _as_pages(x: torch.Tensor, pool: Int2Pool) -> torch.Tensor:
    """[P * 32, Hkv, D] token rows -> [P, 32, Hkv, D] view."""
    if x.dim() != 3 or x.shape[0] % INT2_PAGE:
        raise ValueError(f"expected [P*32, Hkv, D] token rows, got {tuple(x.shape)}")
    t, h, d = x.shape
    if pool.k.shape[1:] != (h, INT2_PAGE, d // 4):
        raise ValueError(f"rows [*, {h}, {d}] do not fit pool {tuple(pool.k.shape)}")
    return x.reshape(t // INT2_PAGE, INT2_PAGE, h, d)


def write_int2_pages_ref(
    pool: Int2Pool, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Torch reference of :func:`write_int2_pages`."""
    kp, vp = _as_pages(k, pool), _as_pages(v, pool)
    if pages.shape != (kp.shape[0],) or vp.shape != kp.shape:
        raise ValueError("pages must be [P] and k, v must both be [P*32, Hkv, D]")
    p = pages.long()
    pool.k[p], pool.k_scale[p], pool.k_zero[p] = quantize_int2_keys_ref(kp)
    pool.v[p], pool.v_scale[p], pool.v_zero[p] = quantize_int2_values_ref(vp)


@triton.jit
def _quantize_int2_keys_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    pages_ptr,
    H,
    D: tl.constexpr,
):
    """One program per (source page, head): per-channel min/max over the page's 32 tokens."""
    p = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, 32)
    offs_d = tl.arange(0, D)
    rows = (p * 32 + t).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xt + h * stride_xh + offs_d[None, :])
    x = x.to(tl.float32)
    scale, zero = asym_params_tl(tl.min(x, 0), tl.max(x, 0), 3)
    codes = asym_codes_tl(x, scale.to(tl.float32)[None, :], zero.to(tl.float32)[None, :], 3)
    packed = pack_int2_u8(codes, 32, D)
    dst = tl.load(pages_ptr + p).to(tl.int64) * H + h
    offs_c = tl.arange(0, D // 4)
    tl.store(codes_ptr + (dst * 32 + t[:, None]) * (D // 4) + offs_c[None, :], packed)
    tl.store(scale_ptr + dst * D + offs_d, scale)
    tl.store(zero_ptr + dst * D + offs_d, zero)


def write_int2_pages(
    pool: Int2Pool,
    pages: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """Quantize whole pages of token rows to INT2 and write them into ``pool`` at ``pages``.

    pool: the layer's INT2 pool. pages: [P] int32/int64 pool-local page ids (row r of page p
    has unified id ``KVPools.int2_base + 32 * p + r``). k, v: [P * 32, Hkv, D]
    bf16/fp16/fp32 token rows, page after page, last dim contiguous.
    """
    kp, vp = _as_pages(k, pool), _as_pages(v, pool)
    if pages.shape != (kp.shape[0],) or vp.shape != kp.shape:
        raise ValueError("pages must be [P] and k, v must both be [P*32, Hkv, D]")
    if resolve_backend(backend, k.device) == "torch":
        write_int2_pages_ref(pool, pages, k, v)
        return
    n_pages, _, h, d = kp.shape
    if n_pages == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    _quantize_int2_keys_kernel[(n_pages, h)](
        k, k.stride(0), k.stride(1), pool.k, pool.k_scale, pool.k_zero, pages, h, D=d, num_warps=4
    )
    launch_quantize_token_groups(
        v,
        pages,
        pool.v,
        pool.v_scale,
        pool.v_zero,
        bits=2,
        tok_div=INT2_PAGE,
        row_a=h * INT2_PAGE,
        row_b=1,
        row_c=INT2_PAGE,
    )
