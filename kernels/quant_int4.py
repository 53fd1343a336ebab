"""INT4 KV quantization: keys and values per token, groups of 32 channels, into the INT4 pool.

``write_int4`` quantizes a batch of token rows and scatters them into given slots of an
:class:`~.pools.Int4Pool` in one kernel pass per tensor (K, then V).
"""

from __future__ import annotations

import torch

from .backend import Backend, resolve_backend
from .pools import Int4Pool
from .quant_token_groups import (
    dequantize_token_groups_ref,
    launch_quantize_token_groups,
    quantize_token_groups_ref,
)


def quantize_int4_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference. x: [..., D] float -> (codes [..., D/2] uint8, scale [..., D/32] fp16,
    zero [..., D/32] fp16)."""
    return quantize_token_groups_ref(x, 4)


def dequantize_int4_ref(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> torch.Tensor:
    """Torch reference. (codes [..., D/2] uint8, scale / zero [..., D/32] fp16) -> [..., D] f32."""
    return dequantize_token_groups_ref(codes, scale, zero, 4)


def _check(pool: Int4Pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(
            f"k and v must both be [T, Hkv, D], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, h, d = k.shape
    if slots.shape != (t,):
        raise ValueError(f"slots must be [T={t}], got {tuple(slots.shape)}")
    if pool.k.shape[1:] != (h, d // 2):
        raise ValueError(f"rows [*, {h}, {d}] do not fit pool {tuple(pool.k.shape)}")


def write_int4_ref(pool: Int4Pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Torch reference of :func:`write_int4`."""
    _check(pool, slots, k, v)
    if pool.k_channel is not None:
        k = k.float() / pool.k_channel
    s = slots.long()
    for x, codes, scale, zero in (
        (k, pool.k, pool.k_scale, pool.k_zero),
        (v, pool.v, pool.v_scale, pool.v_zero),
    ):
        c, sc, z = quantize_int4_ref(x)
        codes[s], scale[s], zero[s] = c, sc, z


def write_int4(
    pool: Int4Pool,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: Backend = "auto",
) -> None:
    """Quantize token rows to INT4 and write them into ``pool`` at ``slots``.

    pool: the layer's INT4 pool. slots: [T] int32/int64 pool-local slot indices (the unified
    id is ``KVPools.int4_base + slot``). k, v: [T, Hkv, D] bf16/fp16/fp32, last dim contiguous.
    Keys are divided by ``pool.k_channel`` first when the pool has one.
    """
    _check(pool, slots, k, v)
    if resolve_backend(backend, k.device) == "torch":
        write_int4_ref(pool, slots, k, v)
        return
    if pool.k_channel is not None:
        k = (k.float() / pool.k_channel).contiguous()
    rows = pool.row_map()
    for x, codes, scale, zero in (
        (k, pool.k, pool.k_scale, pool.k_zero),
        (v, pool.v, pool.v_scale, pool.v_zero),
    ):
        launch_quantize_token_groups(
            x,
            slots,
            codes,
            scale,
            zero,
            bits=4,
            tok_div=1,
            row_a=rows.slot_rows,
            row_b=0,
            row_c=rows.head_rows,
            scale_stride=rows.scale_stride,
        )
