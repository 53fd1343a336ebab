"""MMA fragment layouts and helpers shared by the Gluon decode splits (issue 10):
:mod:`.decode_int2_gluon` and :mod:`.decode_int4_gluon`.

One warp per program; ``mma.sync`` m16n8k16 fragments (``MMA``, ``DA``, ``DB``) with the GQA
group as the 8 columns of the swapped-operand dots. Lane ``(gid, tig) = (lane // 4,
lane % 4)`` are the fragments' coordinates. Nothing here is a kernel; Triton's interpreter
does not run Gluon (the kernels are tested on a GPU and compiled for sm_90 on the CPU).
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # a Triton without Gluon: the Triton splits serve every launch
    gluon = None

GLUON_AVAILABLE = gluon is not None

#: the oldest compute capability the kernels' PTX runs on (cp.async, redux.sync, movmatrix)
MIN_CAPABILITY = (8, 0)


def query_slot_args(q, slot_map) -> tuple:
    """The decode kernels' first launch arguments: ``q`` [B, Hq, D] and its request and head
    strides, ``slot_map`` [B, L] or [B, Hkv, L] and its request and KV-head strides (0 for a
    map shared by the heads)."""
    per_head = slot_map.dim() == 3
    return (
        q,
        q.stride(0),
        q.stride(1),
        slot_map,
        slot_map.stride(0),
        slot_map.stride(1) if per_head else 0,
    )


def head_mask_args(head_mask, stand_in) -> tuple:
    """The head mask's launch arguments: uint8 [B, Hkv, L] and its request and KV-head
    strides; with no mask, ``stand_in`` (a tensor the kernel never reads) and zeros."""
    if head_mask is None:
        return stand_in, 0, 0
    return head_mask, head_mask.stride(0), head_mask.stride(1)


if GLUON_AVAILABLE:
    # Triton 3.6 names the cp.async copy async_copy_global_to_shared and the CTA barrier
    # thread_barrier; later ones async_load and barrier
    cp_load = getattr(_cp, "async_load", None) or _cp.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    DA = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    DB = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    # per-token scales [32 tokens, 4 groups]: tokens gid + 8 j (the accumulator rows), all four
    # groups
    LVS = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[32, 4],
    )
    SH2 = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])

    # this lane's slot-map entry of the block at $2 (DEAD past the end $3, or where the
    # head mask byte at $6 + position is 0 when $7 != 0)
    SLOT_ASM = gl.constexpr(
        """{
.reg .u32 ln;
.reg .s32 pos;
.reg .u64 a;
.reg .u16 m;
.reg .pred p, z;
mov.u32 ln, %laneid;
add.s32 pos, $2, ln;
setp.lt.s32 p, pos, $3;
mov.b32 $0, $4;
mul.wide.s32 a, pos, 4;
add.u64 a, a, $1;
@p ld.global.nc.b32 $0, [a];
setp.ne.and.s32 p, $6, 0, p;
cvt.s64.s32 a, pos;
add.u64 a, a, $5;
mov.u16 m, 1;
@p ld.global.nc.u8 m, [a];
setp.eq.s16 z, m, 0;
@z mov.b32 $0, $4;
}"""
    )

    @gluon.jit
    def slot_of_lane(slot_row, hm_row, start_n, end, dead_id, has_hm):
        """This lane's slot of the block starting at position ``start_n`` (``dead_id`` past
        ``end`` or where the head mask says no; ``has_hm``: 1 if there is one): a value
        per lane (lane l: position ``start_n + l``), which ``redux.sync`` / ``shfl.sync``
        share."""
        return gl.inline_asm_elementwise(
            SLOT_ASM,
            "=r,l,r,r,r,l,r",
            [slot_row, start_n, end, dead_id, hm_row.to(gl.pointer_type(gl.int32)), has_hm],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def movmatrix_b(x):
        """[16, 8] fp16 in the accumulator layout -> the same values as a B operand tile."""
        t = gl.inline_asm_elementwise(
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
            "=r,r",
            [x],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )
        return gl.reshape(gl.permute(gl.reshape(t, [2, 8, 8]), (0, 2, 1)), [16, 8])

    @gluon.jit
    def cat_tokens(t0, t1):
        """Two [16, 8] B tiles (tokens 0-15, 16-31) -> the [32, 8] B operand."""
        x = gl.reshape(gl.permute(gl.join(t0, t1), (2, 0, 1)), [32, 8])
        return gl.convert_layout(x, DB, assert_trivial=True)

    @gluon.jit
    def split8(x, layout: gl.constexpr):
        """[..., 2, 2, 2] -> its 8 sub-tensors in ``layout`` (each a register renaming, asserted),
        index (i2, i1, i0) in that order."""
        x0, x1 = gl.split(x)
        a0, a1 = gl.split(x0)
        b0, b1 = gl.split(x1)
        t000, t100 = gl.split(a0)
        t010, t110 = gl.split(a1)
        t001, t101 = gl.split(b0)
        t011, t111 = gl.split(b1)
        return (
            gl.convert_layout(t000, layout, assert_trivial=True),
            gl.convert_layout(t001, layout, assert_trivial=True),
            gl.convert_layout(t010, layout, assert_trivial=True),
            gl.convert_layout(t011, layout, assert_trivial=True),
            gl.convert_layout(t100, layout, assert_trivial=True),
            gl.convert_layout(t101, layout, assert_trivial=True),
            gl.convert_layout(t110, layout, assert_trivial=True),
            gl.convert_layout(t111, layout, assert_trivial=True),
        )

    @gluon.jit
    def group_scales(vsv):
        """[32 tokens, 4] per-token scales (LVS) -> group g, token tile m: [16] in the MMA rows
        (returned g0m0, g0m1, g1m0, ...)."""
        x = gl.permute(gl.reshape(vsv, [2, 16, 2, 2]), (1, 2, 3, 0))  # r, g1, g0, m
        return split8(x, gl.SliceLayout(1, MMA))

    @gluon.jit
    def head_rows(x):
        """[8] per head (the accumulator's columns) -> [16] per row (heads 0-7, then ones)."""
        y = gl.reshape(gl.permute(gl.join(x, gl.full_like(x, 1.0)), (1, 0)), [16])
        return gl.convert_layout(y, gl.SliceLayout(1, MMA))

    @gluon.jit
    def head_cols(x):
        """[16] per row (heads 0-7, then padding) -> [8] per head (the columns)."""
        a, _ = gl.split(gl.permute(gl.reshape(x, [2, 8]), (1, 0)))
        return gl.convert_layout(a, gl.SliceLayout(0, MMA))

    @gluon.jit
    def softmax_step(s0, s1, mask, m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7,
                     RESCALE_SLACK: gl.constexpr):  # fmt: skip
        """One 32-token block of the online softmax (base 2): scores s0, s1 [16 tokens, 8
        heads] of tokens 0-15 and 16-31, ``mask`` bit t: token t is live. The running max
        ``m_i`` [8] moves (and the sums lsum, zacc and the value accumulators o0..o7 are
        rescaled) only when some head's max grows by more than RESCALE_SLACK: 0 keeps
        p <= 1 (the running max's token exactly 1: no rounding of the dominant term), 4
        (lazy) skips more rescales at p <= 16. Returns (p0, p1 in fp16, m_i, lsum, zacc,
        o0..o7)."""
        tok = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        s0 = gl.where((((mask >> tok) & 1) != 0)[:, None], s0, float("-inf"))
        s1 = gl.where((((mask >> (tok + 16)) & 1) != 0)[:, None], s1, float("-inf"))
        m_new = gl.maximum(m_i, gl.maximum(gl.max(s0, 0), gl.max(s1, 0)))
        if gl.max(m_new - m_i, 0) > RESCALE_SLACK:
            alpha = gl.exp2(m_i - m_new)
            al = alpha[None, :]
            lsum = lsum * al
            zacc = zacc * head_rows(alpha)[:, None]
            o0 = o0 * al
            o1 = o1 * al
            o2 = o2 * al
            o3 = o3 * al
            o4 = o4 * al
            o5 = o5 * al
            o6 = o6 * al
            o7 = o7 * al
            m_i = m_new
        p0 = gl.exp2(s0 - m_i[None, :])
        p1 = gl.exp2(s1 - m_i[None, :])
        lsum = lsum + (p0 + p1)
        return (
            p0.to(gl.float16), p1.to(gl.float16), m_i, lsum, zacc,
            o0, o1, o2, o3, o4, o5, o6, o7,
        )  # fmt: skip

    @gluon.jit
    def value_zeros(p0h, p1h, vsz, zacc):
        """zacc += p @ vsz: ``vsz`` the block's [32 tokens, 8] ``[vs | vz]`` rows in shared
        memory (loaded as the B operand), so columns 4..7 gather ``sum_t p_t vz_tg`` per
        group (p's rows: the heads, 8 of 16 used)."""
        pu = cat_tokens(movmatrix_b(p0h), movmatrix_b(p1h))
        pt = gl.permute(pu, (1, 0))
        pa = gl.reshape(gl.permute(gl.join(pt, gl.zeros_like(pt)), (2, 0, 1)), [16, 32])
        pa = gl.convert_layout(pa, DA, assert_trivial=True)
        return mma_v2(pa, vsz.load(DB), zacc)

    @gluon.jit
    def split_totals(lsum, zacc):
        """After the last block: (l per head, 1 / l (1 where nothing was live), the four
        groups' ``sum p vz`` per head)."""
        l_i = gl.sum(lsum, 0)
        inv = 1.0 / gl.where(l_i > 0.0, l_i, 1.0)
        zc = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        z0 = head_cols(gl.sum(gl.where((zc == 4)[None, :], zacc, 0.0), 1))
        z1 = head_cols(gl.sum(gl.where((zc == 5)[None, :], zacc, 0.0), 1))
        z2 = head_cols(gl.sum(gl.where((zc == 6)[None, :], zacc, 0.0), 1))
        z3 = head_cols(gl.sum(gl.where((zc == 7)[None, :], zacc, 0.0), 1))
        return l_i, inv, z0, z1, z2, z3

    @gluon.jit
    def split_lse(m_i, l_i):
        """The split's log2-sum-exp per head (-inf where nothing was live)."""
        has = l_i > 0.0
        return gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))

    @gluon.jit
    def store_split(po_ptr, plse_ptr, row0, col, S_total, G: gl.constexpr, D: gl.constexpr,
                    m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7,
                    store_tile: gl.constexpr):  # fmt: skip
        """After the last block: the G query heads' partial rows ``(row0 + i) S_total + col``
        of po ([rows, D] fp32, normalised; ``store_tile(po_ptr, prow, hmask, o, z, inv, mt)``
        writes value tile mt, whose channels the kernel's code layout fixes) and plse."""
        l_i, inv, z0, z1, z2, z3 = split_totals(lsum, zacc)
        hq = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        hmask = hq < G
        row_o = (row0 + hq).to(gl.int64) * S_total + col
        prow = row_o * D
        store_tile(po_ptr, prow, hmask, o0, z0, inv, 0)
        store_tile(po_ptr, prow, hmask, o1, z0, inv, 1)
        store_tile(po_ptr, prow, hmask, o2, z1, inv, 2)
        store_tile(po_ptr, prow, hmask, o3, z1, inv, 3)
        store_tile(po_ptr, prow, hmask, o4, z2, inv, 4)
        store_tile(po_ptr, prow, hmask, o5, z2, inv, 5)
        store_tile(po_ptr, prow, hmask, o6, z3, inv, 6)
        store_tile(po_ptr, prow, hmask, o7, z3, inv, 7)
        gl.store(plse_ptr + row_o, split_lse(m_i, l_i), mask=hmask)


__all__ = [
    "head_mask_args",
    "query_slot_args",
    "DA",
    "DB",
    "GLUON_AVAILABLE",
    "LVS",
    "MIN_CAPABILITY",
    "MMA",
    "SH2",
    "cat_tokens",
    "cp_load",
    "cta_barrier",
    "group_scales",
    "head_cols",
    "head_rows",
    "movmatrix_b",
    "slot_of_lane",
    "softmax_step",
    "split8",
    "split_lse",
    "split_totals",
    "store_split",
    "value_zeros",
]
