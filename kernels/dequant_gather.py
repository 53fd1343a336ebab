"""Gather + dequantize KV rows of mixed precision into a dense buffer (prefill over a
cached prefix: the result feeds a standard prefill attention).

Each unified slot id picks its pool by comparison against ``KVPools.int4_base`` /
``int2_base``; DEAD slots (and nothing else) come out as zero rows. The kernel's tuning
knobs are a :class:`GatherConfig`; :data:`GATHER_BASE` is the original kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .packing import (
    codes_to_f32,
    unpack_int2,
    unpack_int2_f32,
    unpack_int4_f32,
    unpack_int4_words_f32,
)
from .pools import DEAD, INT2_PAGE, Int4RowMap, KVPools
from .quant_int4 import dequantize_int4_ref
from .quant_token_groups import dequantize_token_groups_ref

_STORE_CACHE = ("", ".wb", ".cg", ".cs", ".wt")  # Triton's store cache modifiers


@dataclass(frozen=True)
class GatherConfig:
    """Tuning knobs of :func:`dequant_gather` (``benchmarks/dequant_gather.py`` sweeps them on
    the GPU). Every combination gives the same bits (``tests/kernels/``); they change only
    speed. The defaults are the H100 winner of 2026-11-24 (2.10-2.49 TB/s effective kernel
    time in every quantized cell, vs 1.63-1.88 for :data:`GATHER_BASE`, the original
    kernel; docs/benchmarks.md §3). Fields are checked on construction (``ValueError``).

    Attributes:
        block_t: positions (token rows) per program; a power of two >= 16.
        num_warps: warps per program, one of 1, 2, 4, 8.
        int4_words: INT4 rows read as int32 words whose nibbles are channels in order
            (nibble ``i`` of word ``w`` is channel ``8w + i``), instead of bytes unpacked and
            interleaved.
        heads_per_program: KV heads per program, one after the other, so a program writes
            ``block_t`` whole ``[heads_per_program * D]`` output stretches. None: all Hkv
            heads of the pool (resolved at call time); an int must divide Hkv.
        heads_fastest: a 1-D grid ordered head group fastest, so the programs resident at a
            time cover consecutive tokens of every head (one contiguous stretch of the output
            instead of a 1/Hkv slice of a stretch Hkv times longer); else a 2-D grid
            ``(token blocks, head groups)``, token blocks fastest.
        skip_absent: branch over the full / INT4 / INT2 sections a block has no row of (one
            block-wide OR of flags per tile instead of masked work for every precision; the
            tile is held in the output dtype).
        store_cache: cache modifier of the output stores: ``""`` (none), ``".cs"``
            (streaming), ``".cg"``, ``".wb"`` or ``".wt"``. Ignored by the interpreter.
        int2_tile: INT2 rows dequantized as whole ``[block_t, D]`` tiles in channel order
            (each planar code byte read once per channel block, key scales as contiguous
            rows) merged with the full / INT4 rows before a single store, instead of four
            channel-block stores with per-element scale loads.
        offsets32: element offsets in int32 where every tensor has fewer than 2**31
            elements (int64 otherwise, whatever this says).
        slot_rows: (``per_head`` only) read the ``[n, Hkv]`` slot map as given (int32 ids: no
            copy), strided 4-byte slot loads (contiguous with all heads in one program),
            instead of a head-major copy padded to whole blocks made on the host (two small
            kernels before the gather).
    """

    block_t: int = 32
    num_warps: int = 8
    int4_words: bool = True
    heads_per_program: int | None = None
    heads_fastest: bool = True
    skip_absent: bool = True
    store_cache: str = ".cs"
    int2_tile: bool = True
    offsets32: bool = True
    slot_rows: bool = True

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        bt = self.block_t
        if not is_int(bt) or bt < 16 or bt & (bt - 1):
            raise ValueError(f"GatherConfig.block_t must be a power of two >= 16, got {bt!r}")
        if not is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"GatherConfig.num_warps must be 1, 2, 4 or 8, got {self.num_warps!r}")
        hp = self.heads_per_program
        if hp is not None and (not is_int(hp) or hp < 1):
            raise ValueError(
                f"GatherConfig.heads_per_program must be None (all KV heads) or an int >= 1, "
                f"got {hp!r}"
            )
        if self.store_cache not in _STORE_CACHE:
            raise ValueError(
                f"GatherConfig.store_cache must be one of {_STORE_CACHE}, got {self.store_cache!r}"
            )
        for name in (
            "int4_words",
            "heads_fastest",
            "skip_absent",
            "int2_tile",
            "offsets32",
            "slot_rows",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GatherConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def heads(self, num_kv_heads: int) -> int:
        """KV heads per program for a pool of ``num_kv_heads`` heads (``heads_per_program``,
        None: all of them); ``ValueError`` if it does not divide ``num_kv_heads``."""
        hp = num_kv_heads if self.heads_per_program is None else self.heads_per_program
        if num_kv_heads % hp:
            raise ValueError(
                f"GatherConfig.heads_per_program={hp} must divide the pool's Hkv={num_kv_heads}"
            )
        return hp


GATHER_BASE = GatherConfig(
    block_t=32,
    num_warps=4,
    heads_per_program=1,
    heads_fastest=False,
    skip_absent=False,
    store_cache="",
    int2_tile=False,
    offsets32=False,
    slot_rows=False,
)
"""The original kernel (before the launch / memory knobs): a 2-D grid of (32-token block,
one KV head) programs of 4 warps, every precision's section run with masks, int64
offsets, a head-major padded slot copy for per-head maps; INT4 read as words."""

_DEFAULT_CONFIG = GatherConfig()  # built (and checked) once, not per call


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
    rs4,
    rh4,
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
    HEADS: tl.constexpr = 1,
    HEADS_FASTEST: tl.constexpr = False,
    SKIP: tl.constexpr = False,
    STORE_CACHE: tl.constexpr = "",
    INT2_TILE: tl.constexpr = False,
    OFF32: tl.constexpr = False,
    SLOT_ROWS: tl.constexpr = False,
    SS4: tl.constexpr = 0,  # the INT4 scales' row stride (the wrapper passes it)
):
    """One (token block, group of HEADS heads) tile per program (knobs: :class:`GatherConfig`).
    All knobs off (:data:`GATHER_BASE`): a 2-D grid ``(token blocks, Hkv)``, token blocks
    fastest. HEADS_FASTEST: a 1-D grid whose
    consecutive programs take the head groups of one token block (the programs resident at a
    time write one contiguous stretch of the output)."""
    if HEADS_FASTEST:
        n_hg = H // HEADS
        pid = tl.program_id(0)
        blk = pid // n_hg
        h0 = (pid % n_hg) * HEADS
    else:
        blk = tl.program_id(0)
        h0 = tl.program_id(1) * HEADS
    for i in tl.static_range(HEADS):
        _gather_tile(
            blk,
            h0 + i,
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
            rs4,
            rh4,
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
            D,
            BLOCK_T,
            HAS_INT4,
            HAS_INT2,
            PER_HEAD,
            HAS_KCS,
            WORDS,
            SKIP,
            STORE_CACHE,
            INT2_TILE,
            OFF32,
            SLOT_ROWS,
            SS4,
        )


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _gather_tile(
    blk,
    h,
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
    rs4,
    rh4,
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
    SKIP: tl.constexpr,
    STORE_CACHE: tl.constexpr,
    INT2_TILE: tl.constexpr,
    OFF32: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
    SS4: tl.constexpr,
):
    """Rows ``[blk * BLOCK_T, (blk + 1) * BLOCK_T)`` of head ``h``. SKIP: a precision's
    section runs only when a row of the block needs it (one block-wide OR of flags; the
    masked loads and ALU work of absent precisions are branched over)."""
    NG: tl.constexpr = D // 32
    t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    if PER_HEAD and SLOT_ROWS:  # slots as given, [T, Hkv] row-major (stride Hkv)
        s = tl.load(slots_ptr + t * H + h, mask=tm, other=dead_id)
    elif PER_HEAD:  # slots [Hkv, row_stride], head-major: head h reads its own row
        row_start = tl.multiple_of(h * row_stride, BLOCK_T)
        s = tl.load(slots_ptr + row_start + t, mask=tm, other=dead_id)
    else:
        s = tl.load(slots_ptr + t, mask=tm, other=dead_id)
    if not OFF32:  # int64 element offsets (OFF32: every tensor has < 2**31 elements)
        s = s.to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, NG)
    is_full = tm & (s != dead_id) & (s < int4_base)
    is4 = tm & (s >= int4_base) & (s < int2_base)
    is2 = tm & (s >= int2_base)
    keep = tm  # rows written by the k / v store below (INT2 blocks store their own)
    if HAS_INT2 and not INT2_TILE:
        keep = tm & (s < int2_base)
    if SKIP:  # bit 0: a full row, 1: an INT4 row, 2: an INT2 row, 3: a row stored as k / v
        fl = (
            is_full.to(tl.int32)
            | (is4.to(tl.int32) << 1)
            | (is2.to(tl.int32) << 2)
            | (keep.to(tl.int32) << 3)
        )
        flags = tl.reduce(fl, 0, _or)
        do_full = (flags & 1) != 0
        do4 = (flags & 2) != 0
        do2 = (flags & 4) != 0
        do_kv = (flags & 8) != 0
    else:
        do_full = True
        do4 = True
        do2 = True
        do_kv = True
    fo = s[:, None] * stride_fs + h * stride_fh + offs_d[None, :]
    if SKIP:
        # the tile is held in the output dtype (each value rounded once, as the reference:
        # the same bits, half the registers of fp32 for a 16-bit output)
        k = tl.zeros([BLOCK_T, D], dtype=ok_ptr.dtype.element_ty)
        v = tl.zeros([BLOCK_T, D], dtype=ok_ptr.dtype.element_ty)
        if do_full:
            k = tl.load(fk_ptr + fo, mask=is_full[:, None], other=0.0)
            v = tl.load(fv_ptr + fo, mask=is_full[:, None], other=0.0)
            k = k.to(tl.float32).to(ok_ptr.dtype.element_ty)
            v = v.to(tl.float32).to(ok_ptr.dtype.element_ty)
    else:
        k = tl.load(fk_ptr + fo, mask=is_full[:, None], other=0.0).to(tl.float32)
        v = tl.load(fv_ptr + fo, mask=is_full[:, None], other=0.0).to(tl.float32)
    if HAS_INT4:  # noqa: SIM102 (constexpr, then a runtime branch)
        if do4:
            row = tl.where(is4, s - int4_base, 0) * rs4 + h * rh4  # Int4Pool.row_map
            m4 = is4[:, None]
            so = row[:, None] * SS4 + offs_g[None, :]  # SS4: the INT4 scales' row stride
            if WORDS:  # int32 words: nibble i of word w is channel 8w + i (no interleave)
                cw = row[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :]
                kw = tl.load(
                    q4k_ptr.to(tl.pointer_type(tl.int32)) + cw,
                    mask=m4,
                    other=0,
                )
                ku = tl.reshape(unpack_int4_words_f32(kw, BLOCK_T, D // 8), [BLOCK_T, NG, 32])
            else:
                co = row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
                ku = tl.load(q4k_ptr + co, mask=m4, other=0)
                ku = tl.reshape(unpack_int4_f32(ku), [BLOCK_T, NG, 32])
            ks = tl.load(q4ks_ptr + so, mask=m4, other=0.0)
            kz = tl.load(q4kz_ptr + so, mask=m4, other=0.0)
            ks = ks.to(tl.float32)
            kz = kz.to(tl.float32)
            k4 = tl.reshape(ku * ks[:, :, None] + kz[:, :, None], [BLOCK_T, D])
            if HAS_KCS:
                k4 = k4 * tl.load(q4c_ptr + h * D + offs_d)[None, :]
            k = tl.where(m4, k4.to(k.dtype), k)
            if WORDS:
                vw = tl.load(
                    q4v_ptr.to(tl.pointer_type(tl.int32)) + cw,
                    mask=m4,
                    other=0,
                )
                vu = tl.reshape(unpack_int4_words_f32(vw, BLOCK_T, D // 8), [BLOCK_T, NG, 32])
            else:
                vu = tl.load(q4v_ptr + co, mask=m4, other=0)
                vu = tl.reshape(unpack_int4_f32(vu), [BLOCK_T, NG, 32])
            vs = tl.load(q4vs_ptr + so, mask=m4, other=0.0)
            vz = tl.load(q4vz_ptr + so, mask=m4, other=0.0)
            vs = vs.to(tl.float32)
            vz = vz.to(tl.float32)
            v4 = tl.reshape(vu * vs[:, :, None] + vz[:, :, None], [BLOCK_T, D])
            v = tl.where(m4, v4.to(v.dtype), v)
    if HAS_INT2 and INT2_TILE:  # noqa: SIM102 (constexpr, then a runtime branch)
        if do2:  # whole [BLOCK_T, D] rows in natural channel order, merged before one store
            j = tl.where(is2, s - int2_base, 0)
            ph = (j // 32) * H + h
            row = ph * 32 + j % 32
            m2 = is2[:, None]
            cb = row[:, None] * (D // 4) + (offs_d % (D // 4))[None, :]  # planar byte
            sh = (2 * (offs_d // (D // 4)))[None, :]  # its bit pair
            kb = tl.load(q2k_ptr + cb, mask=m2, other=0)
            kc = codes_to_f32((kb.to(tl.int32) >> sh) & 3)
            kso = ph[:, None] * D + offs_d[None, :]
            ks = tl.load(q2ks_ptr + kso, mask=m2, other=0.0).to(tl.float32)
            kz = tl.load(q2kz_ptr + kso, mask=m2, other=0.0).to(tl.float32)
            k = tl.where(m2, (kc * ks + kz).to(k.dtype), k)
            vb = tl.load(q2v_ptr + cb, mask=m2, other=0)
            vc = tl.reshape(codes_to_f32((vb.to(tl.int32) >> sh) & 3), [BLOCK_T, NG, 32])
            vso = row[:, None] * NG + offs_g[None, :]
            vs = tl.load(q2vs_ptr + vso, mask=m2, other=0.0)
            vz = tl.load(q2vz_ptr + vso, mask=m2, other=0.0)
            vs = vs.to(tl.float32)
            vz = vz.to(tl.float32)
            v2 = tl.reshape(vc * vs[:, :, None] + vz[:, :, None], [BLOCK_T, D])
            v = tl.where(m2, v2.to(v.dtype), v)
    if OFF32:
        oo = t[:, None] * stride_ot + h * stride_oh
    else:
        oo = t[:, None].to(tl.int64) * stride_ot + h * stride_oh
    if do_kv:
        tl.store(
            ok_ptr + oo + offs_d[None, :],
            k.to(ok_ptr.dtype.element_ty),
            mask=keep[:, None],
            cache_modifier=STORE_CACHE,
        )
        tl.store(
            ov_ptr + oo + offs_d[None, :],
            v.to(ov_ptr.dtype.element_ty),
            mask=keep[:, None],
            cache_modifier=STORE_CACHE,
        )
    if HAS_INT2 and not INT2_TILE:  # noqa: SIM102 (constexpr, then a runtime branch)
        if do2:
            j = tl.where(is2, s - int2_base, 0)
            ph = (j // 32) * H + h
            row = ph * 32 + j % 32
            m2 = is2[:, None]
            cq = tl.arange(0, D // 4)[None, :]
            co = row[:, None] * (D // 4) + cq
            kb = tl.load(q2k_ptr + co, mask=m2, other=0)
            vb = tl.load(q2v_ptr + co, mask=m2, other=0)
            k0, k1, k2, k3 = unpack_int2_f32(kb)
            v0, v1, v2, v3 = unpack_int2_f32(vb)
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
                STORE_CACHE,
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
                STORE_CACHE,
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
                STORE_CACHE,
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
                STORE_CACHE,
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
    STORE_CACHE: tl.constexpr = "",
):
    """Dequantize and store channel block i (``[i * D/4, (i+1) * D/4)``) of INT2 rows."""
    NG: tl.constexpr = D // 32
    c = i * (D // 4) + cq
    ks = tl.load(ks_ptr + ph[:, None] * D + c, mask=m2, other=0.0).to(tl.float32)
    kz = tl.load(kz_ptr + ph[:, None] * D + c, mask=m2, other=0.0).to(tl.float32)
    g = (i * (D // 4)) // 32 + cq // 32  # the group of each channel of the block
    vs = tl.load(vs_ptr + row[:, None] * NG + g, mask=m2, other=0.0).to(tl.float32)
    vz = tl.load(vz_ptr + row[:, None] * NG + g, mask=m2, other=0.0).to(tl.float32)
    k = (kc * ks + kz).to(ok_ptr.dtype.element_ty)
    v = (vc * vs + vz).to(ov_ptr.dtype.element_ty)
    tl.store(ok_ptr + oo + c, k, mask=m2, cache_modifier=STORE_CACHE)
    tl.store(ov_ptr + oo + c, v, mask=m2, cache_modifier=STORE_CACHE)


def _span(x: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its largest offset + 1)."""
    return 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride(), strict=True) if n > 0)


def dequant_gather(
    pools: KVPools,
    slots: torch.Tensor,
    dead_id: int = DEAD,
    out_dtype: torch.dtype | None = None,
    backend: Backend = "auto",
    per_head: bool = False,
    config: GatherConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather and dequantize the K and V rows of ``slots``.

    pools: one layer's :class:`KVPools`. slots: [...] int32/int64 unified slot ids, any
    mix of precisions, the same id for every KV head; or, with ``per_head=True``,
    [..., Hkv]: head ``h`` of row ``i`` reads cell ``(slots[..., i, h], h)`` (per-(layer, head)
    slot maps). Returns (k, v), each [..., Hkv, D] of ``out_dtype`` (default the full pool's
    dtype); rows whose slot is ``dead_id`` are zero. ``config``: the Triton kernel's tuning
    knobs (:class:`GatherConfig`; None: its defaults, the H100 winner; :data:`GATHER_BASE`:
    the original kernel); the torch backend ignores them, but ``heads_per_program`` must
    divide Hkv either way (``ValueError``).
    """
    cfg = _DEFAULT_CONFIG if config is None else config
    if not isinstance(cfg, GatherConfig):
        raise TypeError(f"config must be a GatherConfig or None, got {type(cfg).__name__}")
    heads = cfg.heads(pools.num_kv_heads)
    dt = out_dtype or pools.dtype
    if resolve_backend(backend, slots.device) == "torch":
        return dequant_gather_ref(pools, slots, dead_id, dt, per_head)
    h, d = pools.num_kv_heads, pools.head_dim
    if per_head and cfg.slot_rows:
        if slots.shape[-1] != h:
            raise ValueError(f"per-head slots must be [..., Hkv={h}], got {tuple(slots.shape)}")
        flat = slots.reshape(-1, h).to(torch.int32).contiguous()  # no copy when int32
        n = flat.shape[0]
        lead = slots.shape[:-1]
    elif per_head:
        if slots.shape[-1] != h:
            raise ValueError(f"per-head slots must be [..., Hkv={h}], got {tuple(slots.shape)}")
        # head-major rows padded to whole blocks: coalesced, aligned slot loads
        rows = slots.reshape(-1, h).t().to(torch.int32)  # int32 ids (int64 trips Triton 3.6)
        flat = rows.new_full((h, triton.cdiv(rows.shape[1], cfg.block_t) * cfg.block_t), dead_id)
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
        for t in q2:
            if not t.is_contiguous():
                raise ValueError("quantized pools must be contiguous")
        rows4 = p4.row_map() if p4 is not None else Int4RowMap(h, 1, d // 32)
        n_blocks = triton.cdiv(n, cfg.block_t)
        if cfg.heads_fastest:
            grid = (n_blocks * (h // heads),)
        else:
            grid = (n_blocks, h // heads)
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
            rows4.slot_rows,
            rows4.head_rows,
            *q2,
            k,
            v,
            k.stride(0),
            k.stride(1),
            D=d,
            BLOCK_T=cfg.block_t,
            HAS_INT4=p4 is not None,
            HAS_INT2=p2 is not None,
            PER_HEAD=per_head,
            HAS_KCS=kcs is not None,
            WORDS=cfg.int4_words,
            HEADS=heads,
            HEADS_FASTEST=cfg.heads_fastest,
            SKIP=cfg.skip_absent,
            STORE_CACHE=cfg.store_cache,
            INT2_TILE=cfg.int2_tile,
            SLOT_ROWS=per_head and cfg.slot_rows,
            SS4=rows4.scale_stride,
            OFF32=cfg.offsets32 and all(_span(x) < 2**31 for x in (f.k, f.v, k, *q4, *q2)),
            num_warps=cfg.num_warps,
        )
    shape = (*lead, h, d)
    return k.reshape(shape), v.reshape(shape)
