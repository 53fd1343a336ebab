"""Gather + dequantize KV rows of mixed precision into a dense buffer (prefill over a
cached prefix: the result feeds a standard prefill attention).

Each unified slot id picks its pool by comparison against ``KVPools.int4_base`` /
``int2_base``; DEAD slots (and nothing else) come out as zero rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .packing import unpack_int2, unpack_int2_f32, unpack_int4_f32, unpack_int4_words_f32
from .pools import DEAD, INT2_PAGE, KVPools
from .quant_int4 import dequantize_int4_ref
from .quant_token_groups import dequantize_token_groups_ref


def dequant_gather_ref(
    pools: KVPools,
    slots: torch.Tensor,
    dead_id: int = DEAD,
    out_dtype: torch.dtype | None = None,
    per_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`dequant_gather`."""
    h, d = pools.num_kv_heads, pools.head_dim
    if per_head:
        if slots.shape[-1] != h:
            raise ValueError(f"per-head slots must be [..., Hkv={h}], got {tuple(slots.shape)}")
        s = slots.reshape(-1, h).long()
        lead = slots.shape[:-1]
    else:
        s = slots.reshape(-1, 1).long().expand(-1, h)
        lead = slots.shape
    n = s.shape[0]
    hh = torch.arange(h, device=s.device)[None, :].expand(n, h)
    k = torch.zeros(n, h, d, dtype=torch.float32, device=s.device)
    v = torch.zeros_like(k)
    full = (s < pools.int4_base) & (s != dead_id)
    k[full] = pools.full.k[s[full], hh[full]].float()
    v[full] = pools.full.v[s[full], hh[full]].float()
    if pools.int4 is not None:
        sel = (s >= pools.int4_base) & (s < pools.int2_base)
        i, hs = s[sel] - pools.int4_base, hh[sel]
        p4 = pools.int4
        k[sel] = dequantize_int4_ref(p4.k[i, hs], p4.k_scale[i, hs], p4.k_zero[i, hs])
        if p4.k_channel is not None:
            k[sel] = k[sel] * p4.k_channel[hs]
        v[sel] = dequantize_int4_ref(p4.v[i, hs], p4.v_scale[i, hs], p4.v_zero[i, hs])
    if pools.int2 is not None:
        sel = s >= pools.int2_base
        j, hs = s[sel] - pools.int2_base, hh[sel]
        page, row = j // INT2_PAGE, j % INT2_PAGE
        p2 = pools.int2
        codes = unpack_int2(p2.k[page, hs, row]).float()  # [m, D]
        k[sel] = codes * p2.k_scale[page, hs].float() + p2.k_zero[page, hs].float()
        v[sel] = dequantize_token_groups_ref(
            p2.v[page, hs, row], p2.v_scale[page, hs, row], p2.v_zero[page, hs, row], 2
        )
    dt = out_dtype or pools.dtype
    shape = (*lead, h, d)
    return k.to(dt).reshape(shape), v.to(dt).reshape(shape)


@triton.jit
def _dequant_gather_kernel(
    slots_ptr,
    row_stride,
    T,
    dead_id,
    int4_base,
    int2_base,
    H,
    fk_ptr,
    fv_ptr,
    stride_fs,
    stride_fh,
    q4k_ptr,
    q4v_ptr,
    q4ks_ptr,
    q4kz_ptr,
    q4vs_ptr,
    q4vz_ptr,
    q4c_ptr,
    q2k_ptr,
    q2v_ptr,
    q2ks_ptr,
    q2kz_ptr,
    q2vs_ptr,
    q2vz_ptr,
    ok_ptr,
    ov_ptr,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_INT4: tl.constexpr,
    HAS_INT2: tl.constexpr,
    PER_HEAD: tl.constexpr,
    HAS_KCS: tl.constexpr,
    WORDS: tl.constexpr,
):
    NG: tl.constexpr = D // 32
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    if PER_HEAD:  # slots [Hkv, row_stride], head-major: head h reads its own row
        row_start = tl.multiple_of(h * row_stride, BLOCK_T)
        s = tl.load(slots_ptr + row_start + t, mask=tm, other=dead_id).to(tl.int64)
    else:
        s = tl.load(slots_ptr + t, mask=tm, other=dead_id).to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, NG)
    is_full = tm & (s != dead_id) & (s < int4_base)
    fo = s[:, None] * stride_fs + h * stride_fh + offs_d[None, :]
    k = tl.load(fk_ptr + fo, mask=is_full[:, None], other=0.0).to(tl.float32)
    v = tl.load(fv_ptr + fo, mask=is_full[:, None], other=0.0).to(tl.float32)
    if HAS_INT4:
        is4 = tm & (s >= int4_base) & (s < int2_base)
        row = tl.where(is4, s - int4_base, 0) * H + h
        m4 = is4[:, None]
        so = row[:, None] * NG + offs_g[None, :]
        if WORDS:  # int32 words: nibble i of word w is channel 8w + i (no interleave)
            cw = row[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :]
            kw = tl.load(q4k_ptr.to(tl.pointer_type(tl.int32)) + cw, mask=m4, other=0)
            ku = tl.reshape(unpack_int4_words_f32(kw, BLOCK_T, D // 8), [BLOCK_T, NG, 32])
        else:
            co = row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
            ku = tl.load(q4k_ptr + co, mask=m4, other=0)
            ku = tl.reshape(unpack_int4_f32(ku), [BLOCK_T, NG, 32])
        ks = tl.load(q4ks_ptr + so, mask=m4, other=0.0).to(tl.float32)
        kz = tl.load(q4kz_ptr + so, mask=m4, other=0.0).to(tl.float32)
        k4 = tl.reshape(ku * ks[:, :, None] + kz[:, :, None], [BLOCK_T, D])
        if HAS_KCS:
            k4 = k4 * tl.load(q4c_ptr + h * D + offs_d)[None, :]
        k = tl.where(m4, k4, k)
        if WORDS:
            vw = tl.load(q4v_ptr.to(tl.pointer_type(tl.int32)) + cw, mask=m4, other=0)
            vu = tl.reshape(unpack_int4_words_f32(vw, BLOCK_T, D // 8), [BLOCK_T, NG, 32])
        else:
            vu = tl.load(q4v_ptr + co, mask=m4, other=0)
            vu = tl.reshape(unpack_int4_f32(vu), [BLOCK_T, NG, 32])
        vs = tl.load(q4vs_ptr + so, mask=m4, other=0.0).to(tl.float32)
        vz = tl.load(q4vz_ptr + so, mask=m4, other=0.0).to(tl.float32)
        v4 = tl.reshape(vu * vs[:, :, None] + vz[:, :, None], [BLOCK_T, D])
        v = tl.where(m4, v4, v)
    oo = t[:, None].to(tl.int64) * stride_ot + h * stride_oh
    keep = tm
    if HAS_INT2:
        keep = tm & (s < int2_base)
    tl.store(ok_ptr + oo + offs_d[None, :], k.to(ok_ptr.dtype.element_ty), mask=keep[:, None])
    tl.store(ov_ptr + oo + offs_d[None, :], v.to(ov_ptr.dtype.element_ty), mask=keep[:, None])
    if HAS_INT2:
        is2 = tm & (s >= int2_base)
        j = tl.where(is2, s - int2_base, 0)
        ph = (j // 32) * H + h
        row = ph * 32 + j % 32
        m2 = is2[:, None]
        cq = tl.arange(0, D // 4)[None, :]
        co = row[:, None] * (D // 4) + cq
        k0, k1, k2, k3 = unpack_int2_f32(tl.load(q2k_ptr + co, mask=m2, other=0))
        v0, v1, v2, v3 = unpack_int2_f32(tl.load(q2v_ptr + co, mask=m2, other=0))
        _int2_store_block(
            0,
            k0,
            v0,
            ph,
            row,
            m2,
            cq,
            oo,
            q2ks_ptr,
            q2kz_ptr,
            q2vs_ptr,
            q2vz_ptr,
            ok_ptr,
            ov_ptr,
            D,
        )
        _int2_store_block(
            1,
            k1,
            v1,
            ph,
            row,
            m2,
            cq,
            oo,
            q2ks_ptr,
            q2kz_ptr,
            q2vs_ptr,
            q2vz_ptr,
            ok_ptr,
            ov_ptr,
            D,
        )
        _int2_store_block(
            2,
            k2,
            v2,
            ph,
            row,
            m2,
            cq,
            oo,
            q2ks_ptr,
            q2kz_ptr,
            q2vs_ptr,
            q2vz_ptr,
            ok_ptr,
            ov_ptr,
            D,
        )
        _int2_store_block(
            3,
            k3,
            v3,
            ph,
            row,
            m2,
            cq,
            oo,
            q2ks_ptr,
            q2kz_ptr,
            q2vs_ptr,
            q2vz_ptr,
            ok_ptr,
            ov_ptr,
            D,
        )


@triton.jit
def _int2_store_block(
    i: tl.constexpr,
    kc,
    vc,
    ph,
    row,
    m2,
    cq,
    oo,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    ok_ptr,
    ov_ptr,
    D: tl.constexpr,
):
    """Dequantize and store channel block i (``[i * D/4, (i+1) * D/4)``) of INT2 rows."""
    NG: tl.constexpr = D // 32
    c = i * (D // 4) + cq
    ks = tl.load(ks_ptr + ph[:, None] * D + c, mask=m2, other=0.0).to(tl.float32)
    kz = tl.load(kz_ptr + ph[:, None] * D + c, mask=m2, other=0.0).to(tl.float32)
    g = (i * (D // 4)) // 32 + cq // 32  # the group of each channel of the block
    vs = tl.load(vs_ptr + row[:, None] * NG + g, mask=m2, other=0.0).to(tl.float32)
    vz = tl.load(vz_ptr + row[:, None] * NG + g, mask=m2, other=0.0).to(tl.float32)
    tl.store(ok_ptr + oo + c, (kc * ks + kz).to(ok_ptr.dtype.element_ty), mask=m2)
    tl.store(ov_ptr + oo + c, (vc * vs + vz).to(ov_ptr.dtype.element_ty), mask=m2)


def dequant_gather(
    pools: KVPools,
    slots: torch.Tensor,
    dead_id: int = DEAD,
    out_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
    block_t: int = 32,
    per_head: bool = False,
    num_warps: int = 4,
    int4_words: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather and dequantize the K and V rows of ``slots``.

    pools: one layer's :class:`KVPools`. slots: [...] int32/int64 unified slot ids, any
    mix of precisions, the same id for every KV head; or, with ``per_head=True``,
    [..., Hkv]: head ``h`` of row ``i`` reads cell ``(slots[..., i, h], h)`` (per-(layer, head)
    slot maps). Returns (k, v), each [..., Hkv, D] of ``out_dtype`` (default the full pool's
    dtype); rows whose slot is ``dead_id`` are zero. ``block_t`` (positions per program)
    and ``num_warps`` are tuning knobs (``benchmarks/dequant_gather.py``), as is
    ``int4_words`` (INT4 rows read as int32 words whose nibbles are channels in order,
    instead of bytes unpacked and interleaved).
    """
    dt = out_dtype or pools.dtype
    if resolve_backend(backend, slots.device) == "torch":
        return dequant_gather_ref(pools, slots, dead_id, dt, per_head)
    h, d = pools.num_kv_heads, pools.head_dim
    if per_head:
        if slots.shape[-1] != h:
            raise ValueError(f"per-head slots must be [..., Hkv={h}], got {tuple(slots.shape)}")
        # head-major rows padded to whole blocks: coalesced, aligned slot loads
        rows = slots.reshape(-1, h).t().to(torch.int32)  # int32 ids (int64 trips Triton 3.6)
        flat = rows.new_full((h, triton.cdiv(rows.shape[1], block_t) * block_t), dead_id)
        flat[:, : rows.shape[1]] = rows
        n = rows.shape[1]
        lead = slots.shape[:-1]
    else:
        flat = slots.reshape(-1).to(torch.int32).contiguous()
        n = flat.numel()
        lead = slots.shape
    k = torch.empty(n, h, d, dtype=dt, device=slots.device)
    v = torch.empty_like(k)
    if n:
        p4, p2, f = pools.int4, pools.int2, pools.full
        if f.k.stride() != f.v.stride() or f.k.stride(-1) != 1:
            raise ValueError("full pool k and v need equal strides and a contiguous last dim")
        dummy = f.k  # placeholder pointer for absent pools (never dereferenced)
        q4 = (
            [dummy] * 6
            if p4 is None
            else [p4.k, p4.v, p4.k_scale, p4.k_zero, p4.v_scale, p4.v_zero]
        )
        kcs = p4.k_channel if p4 is not None and p4.k_channel is not None else None
        q2 = (
            [dummy] * 6
            if p2 is None
            else [p2.k, p2.v, p2.k_scale, p2.k_zero, p2.v_scale, p2.v_zero]
        )
        for t in q4 + q2:
            if not t.is_contiguous():
                raise ValueError("quantized pools must be contiguous")
        grid = (triton.cdiv(n, block_t), h)
        _dequant_gather_kernel[grid](
            flat,
            flat.shape[-1],
            n,
            dead_id,
            pools.int4_base,
            pools.int2_base,
            h,
            f.k,
            f.v,
            f.k.stride(0),
            f.k.stride(1),
            *q4,
            kcs if kcs is not None else dummy,
            *q2,
            k,
            v,
            k.stride(0),
            k.stride(1),
            D=d,
            BLOCK_T=block_t,
            HAS_INT4=p4 is not None,
            HAS_INT2=p2 is not None,
            PER_HEAD=per_head,
            HAS_KCS=kcs is not None,
            WORDS=int4_words,
            num_warps=num_warps,
        )
    shape = (*lead, h, d)
    return k.reshape(shape), v.reshape(shape)
