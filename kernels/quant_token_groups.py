"""Per-token quantization in groups of 32 channels (INT4 keys/values, INT2 values).

Each token row of each head is cut into ``D // 32`` groups; every group gets its own fp16
scale and zero (asymmetric, see :mod:`asymmetric_quant`) and its codes are packed into
uint8 (:mod:`packing`). The Triton kernel quantizes and scatters in one pass: source row
``(t, h)`` lands in destination row ``idx[t // TOK_DIV] * row_a + (t % TOK_DIV) * row_b +
h * row_c`` of flat code / scale / zero buffers, which covers both the INT4 token pool
(``TOK_DIV = 1``) and the values of INT2 pages (``TOK_DIV = 32``).
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
from .packing import pack_int2, pack_int2_u8, pack_int4, pack_int4_u8, unpack_int2, unpack_int4
from .pools import GROUP_SIZE, row_stride


def quantize_token_groups_ref(
    x: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference. x: [..., D] float -> (codes [..., D*bits/8] uint8,
    scale [..., D/32] fp16, zero [..., D/32] fp16)."""
    d = x.shape[-1]
    g = x.float().reshape(*x.shape[:-1], d // GROUP_SIZE, GROUP_SIZE)
    qmax = (1 << bits) - 1
    scale, zero = asym_params(g.amin(-1), g.amax(-1), qmax)
    codes = asym_codes(g, scale[..., None], zero[..., None], qmax).reshape(x.shape)
    packed = pack_int4(codes) if bits == 4 else pack_int2(codes)
    return packed, scale, zero


def dequantize_token_groups_ref(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """Torch reference. (codes [..., D*bits/8] uint8, scale / zero [..., D/32] fp16)
    -> [..., D] float32."""
    codes = unpack_int4(packed) if bits == 4 else unpack_int2(packed)
    d = codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], d // GROUP_SIZE, GROUP_SIZE)
    return asym_dequant(g, scale[..., None], zero[..., None]).reshape(codes.shape)


@triton.jit
def _quantize_token_groups_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    idx_ptr,
    T,
    row_a,
    row_b,
    row_c,
    scale_stride,
    D: tl.constexpr,
    BITS: tl.constexpr,
    TOK_DIV: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    NG: tl.constexpr = D // 32
    CB: tl.constexpr = D * BITS // 8
    QMAX: tl.constexpr = (1 << BITS) - 1
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    offs_d = tl.arange(0, D)
    x = tl.load(
        x_ptr + t[:, None].to(tl.int64) * stride_xt + h * stride_xh + offs_d[None, :],
        mask=tmask[:, None],
        other=0.0,
    ).to(tl.float32)
    x3 = tl.reshape(x, [BLOCK_T, NG, 32])
    scale, zero = asym_params_tl(tl.min(x3, 2), tl.max(x3, 2), QMAX)
    codes = asym_codes_tl(
        x3, scale.to(tl.float32)[:, :, None], zero.to(tl.float32)[:, :, None], QMAX
    )
    codes = tl.reshape(codes, [BLOCK_T, D])
    if BITS == 4:
        packed = pack_int4_u8(codes, BLOCK_T, D)
    else:
        packed = pack_int2_u8(codes, BLOCK_T, D)
    idx = tl.load(idx_ptr + t // TOK_DIV, mask=tmask, other=0).to(tl.int64)
    row = idx * row_a + (t % TOK_DIV) * row_b + h * row_c
    offs_c = tl.arange(0, CB)
    tl.store(codes_ptr + row[:, None] * CB + offs_c[None, :], packed, mask=tmask[:, None])
    offs_g = tl.arange(0, NG)
    so = row[:, None] * scale_stride + offs_g[None, :]
    tl.store(scale_ptr + so, scale, mask=tmask[:, None])
    tl.store(zero_ptr + so, zero, mask=tmask[:, None])


def launch_quantize_token_groups(
    x: torch.Tensor,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    bits: int,
    tok_div: int,
    row_a: int,
    row_b: int,
    row_c: int,
    scale_stride: int | None = None,
    block_t: int = 16,
) -> None:
    """Triton launch. x: [T, H, D] (last dim contiguous); idx: [ceil(T / tok_div)] int;
    codes: a destination buffer (its first element the base) viewed as rows of
    ``D*bits/8`` bytes; scale / zero: rows of ``D/32`` fp16 values ``scale_stride`` apart in
    the same row order (None: contiguous codes and evenly spaced scale rows, whose stride
    is read; an :class:`~.pools.Int4Pool`'s writer passes its
    :meth:`~.pools.Int4Pool.row_map`, which checked the layout). See the module docstring
    for the row map."""
    t, h, d = x.shape
    if t == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    ss = scale_stride
    if ss is None:
        ss = row_stride(scale)
        if not codes.is_contiguous() or ss is None or row_stride(zero) != ss:
            raise ValueError(
                "codes must be contiguous, scale and zero rows of D/32 values at one row stride"
            )
    grid = (triton.cdiv(t, block_t), h)
    _quantize_token_groups_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        codes,
        scale,
        zero,
        idx,
        t,
        row_a,
        row_b,
        row_c,
        ss,
        D=d,
        BITS=bits,
        TOK_DIV=tok_div,
        BLOCK_T=block_t,
        num_warps=4,
    )
