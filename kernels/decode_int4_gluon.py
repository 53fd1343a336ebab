"""The INT4 decode split as a Gluon kernel with explicit register layouts (issue 10).

Same contract and the same partial outputs as the INT4 split of :mod:`.decode_attention`
(scales folded out of the codes: keys ``sum_g ks_tg (q_g . c_tg) + kz_tg sum(q_g)``, values
``sum_t (p_t vs_tg) c_t + sum_t p_t vz_tg``), for the INT4 segment's splits (head_dim 128, a
GQA group of at most 8; the other segments of a launch run on that module's kernel). It
takes the techniques of :mod:`.decode_int2_gluon` to the INT4 token pool:

* **Swapped operands.** Per channel group ``g``, ``D_g^T = codes_g @ q_g^T`` (tokens as the
  16 MMA rows, the GQA group as 8 columns); the scores are ``sum_g ks_g D_g + kz_g sum(q_g)``
  in fp32 (each token's scales are per row of the accumulator; the ``kz`` term is itself a
  dot: the staged ``[ks | kz | vs | vz]`` rows against ``sum(q_g)`` in fp16 hi + lo parts,
  exact products). Values: ``O^T = codes^T @ (p * vs_g)^T``, channels as rows, one group's
  32 channels per two tiles.
* **Codes made in the operand layout, as fp16 subnormals.** The key words arrive by
  ``ldmatrix`` (a lane holds 8 channels of one token per group) and turn into pairs of fp16
  subnormals with one shift per word (bytes 0-2 and 1-3 paired) and one ``and`` per pair
  (``(n << 4e) 2**-24``: the odd channel of a byte is left in place, ``x16``, the query row
  takes the ``1/16``). The value words arrive by ``ldmatrix.trans``, so a register holds
  one channel byte pair of two consecutive tokens: an ``and`` (and a shift for the second
  byte) gives the value dot's token pairs directly. Every ``convert_layout`` in the loop is
  asserted trivial.
* **Scores to the value operand in registers** (``movmatrix``), ``sum_t p_t vz_tg`` by a dot of
  ``p`` against the block's ``[vs | vz]`` rows, as in the INT2 kernel.
* **Token-slot gathers by ``cp.async``, four lanes to a row.** Lane ``l`` reads position
  ``l``'s slot (two blocks ahead); ``shfl.sync`` hands each lane the slots of the rows it
  copies: a token's 64-byte key and value code rows are four lanes' 16-byte pieces (one
  instruction covers 8 rows, 8 cache lines: with a lane per row it touched 32 and the split
  ran 1.4x slower), its interleaved 32 bytes of scales two lanes' (``NS`` stages); DEAD rows
  are not read, ``redux.sync`` makes the block's live mask.

One warp per program, grid (KV head, split, request). Triton's interpreter does not run
Gluon: the CPU tests run the Triton split; this kernel is tested against the torch
reference on a GPU (``tests/kernels/test_decode_int4_gluon.py``) and compiled for sm_90 on
the CPU (``tests/bench/test_decode_sass.py``).
"""

from __future__ import annotations

import torch

from .gluon_fragments import GLUON_AVAILABLE, head_mask_args, query_slot_args

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from .gluon_fragments import (
        DA,
        DB,
        LVS,
        MMA,
        SH2,
        cat_tokens,
        cp_load,
        cta_barrier,
        group_scales,
        movmatrix_b,
        slot_of_lane,
        softmax_step,
        split8,
        store_split,
        value_zeros,
    )

#: cp.async stages: one block in compute, two in flight (H200, session 22: 2 stages give 16
#: programs per SM instead of 12 and ran up to 25% slower: the copies' latency shows)
STAGES = 3
#: registers per thread (ptxas ``.maxnreg``)
MAX_REGISTERS = 128

if GLUON_AVAILABLE:
    # key half-words [32 tokens, 32]: lane (gid, tig) holds tokens gid + 8 j and, per channel
    # group g (half-words 8 g .. 8 g + 7), the word 2 tig, 2 tig + 1 (an ldmatrix of 8 x 8)
    LK = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [0, 16], [8, 0], [16, 0]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[32, 32],
    )
    # value half-words [32 tokens, 32]: lane (gid, tig) holds half-word 8 g + gid of tokens
    # 2 tig + e + 8 a + 16 kt (an ldmatrix.trans of 8 x 8: e pairs two tokens in a register)
    LV = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0], [0, 8], [0, 16]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[],
        block_bases=[],
        shape=[32, 32],
    )
    # cp.async tiles: four lanes copy a token's 64-byte code row (one instruction: 8 rows,
    # 8 cache lines, where a lane per row would touch 32), two its 32 bytes of interleaved
    # scales; separate scale tensors: a lane per row's 8-byte run
    CKV = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])  # [32, 32] int16
    CS16 = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])  # [32, 16] fp16
    CS4 = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])  # [32, 4] fp16
    # code rows: 16-byte chunks swizzled by row pair, so an ldmatrix phase (8 rows of 16
    # bytes, rows 64 bytes apart) meets 32 distinct banks
    SHC = gl.SwizzledSharedLayout(8, 2, 4, order=[1, 0])

    # key word (channels 8 w .. 8 w + 7 of one token: byte j holds 2 j, 2 j + 1) -> output
    # ks + 2 a holds channels (2 ks + a, 2 ks + a + 4), as fp16 subnormals; a = 1 left x16
    # (bytes 0 and 2 pair up, then 1 and 3: one shift, where pairing 0-1 and 2-3 took two
    # byte permutes)
    KEY4_ASM = gl.constexpr(
        """{
.reg .b32 t;
shr.b32 t, $4, 8;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, t, 0x000F000F;
and.b32 $2, $4, 0x00F000F0;
and.b32 $3, t, 0x00F000F0;
}"""
    )
    # value register (one half-word, channels 4 x .. 4 x + 3, of two consecutive tokens) ->
    # output h + 2 u holds channel 4 x + u + 2 h of both tokens (fp16 subnormals; u = 1 left
    # x16)
    VAL4_ASM = gl.constexpr(
        """{
.reg .b32 t;
shr.b32 t, $4, 8;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, t, 0x000F000F;
and.b32 $2, $4, 0x00F000F0;
and.b32 $3, t, 0x00F000F0;
}"""
    )
    # (the block's live rows: bit l set where lane l's position maps to a live slot)
    LIVE_ASM = gl.constexpr(
        """{
.reg .u32 ln, b;
.reg .pred p;
mov.u32 ln, %laneid;
setp.ne.s32 p, $1, $2;
shl.b32 b, 1, ln;
selp.b32 b, b, 0, p;
redux.sync.or.b32 $0, b, 0xffffffff;
}"""
    )

    @gluon.jit
    def _row_slots(slot, layout: gl.constexpr):
        """[32] slots of the block's rows in ``layout`` (a slice of a copy tile): row r's is
        lane r's ``slot``, fetched by ``shfl.sync``."""
        rows = gl.arange(0, 32, layout=layout)
        return gl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
            "=r,r,r",
            [gl.full([32], 0, gl.int32, layout) + slot, rows],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _row_offsets(slot, dead_id, int4_base, slot_rows, head_row, layout: gl.constexpr):
        """([32] (token, head) row of each block row in ``layout``: ``slot * slot_rows +
        head_row``, :meth:`~.pools.Int4Pool.row_map`; [32] live)."""
        sl = _row_slots(slot, layout)
        live = sl != dead_id
        return (gl.where(live, sl - int4_base, 0) * slot_rows + head_row).to(gl.int64), live

    @gluon.jit
    def _live_mask(slot, dead_id):
        """The block's live rows (bit l: lane l's ``slot`` is not DEAD), in every lane."""
        return gl.inline_asm_elementwise(
            LIVE_ASM, "=r,r,r", [slot, dead_id], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _issue4(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, ss, st, slot, dead_id,
                int4_base, slot_rows, head_row, D: gl.constexpr, SSTRIDE: gl.constexpr,
                INTERLEAVED: gl.constexpr):  # fmt: skip
        """cp.async the block's tokens (lane l's ``slot``: token l's) into stage ``st``: their
        key and value code rows and their [ks | kz | vs | vz] (one commit group; INTERLEAVED:
        one 32-byte run at ``ks_ptr``, else four 8-byte ones)."""
        rk, lk = _row_offsets(slot, dead_id, int4_base, slot_rows, head_row, gl.SliceLayout(1, CKV))
        ck = gl.arange(0, D // 4, layout=gl.SliceLayout(0, CKV))
        lk = lk[:, None]
        off = rk[:, None] * (D // 4) + ck[None, :]
        cp_load(sk.index(st), k_ptr.to(gl.pointer_type(gl.int16)) + off, mask=lk)
        cp_load(sv.index(st), v_ptr.to(gl.pointer_type(gl.int16)) + off, mask=lk)
        if INTERLEAVED:
            rs, ls = _row_offsets(
                slot, dead_id, int4_base, slot_rows, head_row, gl.SliceLayout(1, CS16)
            )
            cs = gl.arange(0, 16, layout=gl.SliceLayout(0, CS16))
            cp_load(ss.index(st), ks_ptr + (rs[:, None] * SSTRIDE + cs[None, :]), mask=ls[:, None])
        else:
            rs, ls = _row_offsets(
                slot, dead_id, int4_base, slot_rows, head_row, gl.SliceLayout(1, CS4)
            )
            cs = gl.arange(0, 4, layout=gl.SliceLayout(0, CS4))
            so = rs[:, None] * SSTRIDE + cs[None, :]
            ls = ls[:, None]
            cp_load(ss.index(st).slice(0, 4, dim=1), ks_ptr + so, mask=ls)
            cp_load(ss.index(st).slice(4, 4, dim=1), kz_ptr + so, mask=ls)
            cp_load(ss.index(st).slice(8, 4, dim=1), vs_ptr + so, mask=ls)
            cp_load(ss.index(st).slice(12, 4, dim=1), vz_ptr + so, mask=ls)
        _cp.commit_group()

    @gluon.jit
    def _key_tiles(kw):
        """[32 tokens, 32] int16 key half-words (LK) -> A tiles [16 tokens, 32 k] of (token
        tile m, group g), returned (m0 g0, m0 g1, .., m1 g3); k = e + 2 tig + 8 a + 16 ks is
        channel 32 g + 8 tig + 2 ks + a + 4 e (a = 1: x16)."""
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            KEY4_ASM, "=r,=r,=r,=r,r", [kw], dtype=(gl.float16,) * 4, is_pure=True, pack=2
        )
        # (a join's index is the new last dim: the outer join's is last; KEY4_ASM orders
        # its outputs ks + 2 a for that)
        x = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [tok, hw, ks, a]
        x = gl.reshape(x, [2, 16, 2, 2, 4, 2, 2, 2])  # m, r, g1, g0, tig, e, ks, a
        x = gl.permute(x, (1, 6, 7, 4, 5, 0, 2, 3))  # r, ks, a, tig, e, m, g1, g0
        x = gl.reshape(x, [16, 32, 2, 2, 2])
        return split8(x, gl.constexpr(DA))

    @gluon.jit
    def _val_tiles(vw):
        """[32 tokens, 32] int16 value half-words (LV) -> A tiles [16 rows, 32 tokens] of
        (group g, u), returned (g0 u0, g0 u1, g1 u0, ..); row 8 h + i is channel
        32 g + 4 i + u + 2 h (u = 1: x16)."""
        c0, c1, c2, c3 = gl.inline_asm_elementwise(
            VAL4_ASM, "=r,=r,=r,=r,r", [vw], dtype=(gl.float16,) * 4, is_pure=True, pack=2
        )
        x = gl.join(gl.join(c0, c1), gl.join(c2, c3))  # [tok, hw, h, u] (VAL4_ASM's order)
        x = gl.reshape(x, [32, 2, 2, 8, 2, 2])  # tok, g1, g0, i, h, u
        x = gl.permute(x, (4, 3, 0, 1, 2, 5))  # h, i, tok, g1, g0, u
        x = gl.reshape(x, [16, 32, 2, 2, 2])
        return split8(x, gl.constexpr(DA))

    @gluon.jit
    def _q_group(q_ptr, stride_qb, stride_qh, kcs_ptr, sq, b, h, qk_scale,
                 G: gl.constexpr, D: gl.constexpr, HAS_KCS: gl.constexpr, g: gl.constexpr):  # fmt: skip
        """Group g's query (times the per-channel key scale) into ``sq[g]`` as the key dot's B
        operand [32 k, 8 heads] (k order of :func:`_key_tiles`, rows with a = 1 times 1/16);
        returns ``qk_scale * sum(q_g)`` per head ([8] fp32, the B operand's columns)."""
        kk = gl.arange(0, 32, layout=gl.SliceLayout(1, DB))
        hh = gl.arange(0, 8, layout=gl.SliceLayout(0, DB))
        a = (kk // 8) % 2
        cc = 32 * g + 8 * ((kk // 2) % 4) + 2 * (kk // 16) + a + 4 * (kk % 2)
        qp = q_ptr + b * stride_qb + (h * G + hh)[None, :] * stride_qh + cc[:, None]
        qv = gl.load(qp, mask=(hh < G)[None, :], other=0.0).to(gl.float32)
        if HAS_KCS:
            qv = qv * gl.load(kcs_ptr + h * D + cc)[:, None]
        sq.index(g).store((qv * gl.where(a == 1, 0.0625, 1.0)[:, None]).to(gl.float16))
        return gl.sum(qv, 0) * qk_scale

    @gluon.jit
    def _zero_dot_operands(qs0, qs1, qs2, qs3):
        """The key zeros' dot's B operand [16 k, 8 heads] against a stage's ``[ks | kz | vs |
        vz]`` rows (k = 4 + g: ``qs_g``, the other rows 0), split into fp16 hi and lo parts
        (their sum is ``qs_g`` to ~2**-22: the dot's products are exact)."""
        kk = gl.arange(0, 16, layout=gl.SliceLayout(1, DB))[:, None]
        bz = gl.where(kk == 4, qs0[None, :], 0.0)
        bz = gl.where(kk == 5, qs1[None, :], bz)
        bz = gl.where(kk == 6, qs2[None, :], bz)
        bz = gl.where(kk == 7, qs3[None, :], bz)
        hi = bz.to(gl.float16)
        return hi, (bz - hi.to(gl.float32)).to(gl.float16)

    @gluon.jit
    def _scores(a0, a1, a2, a3, sq, ks0, ks1, ks2, ks3, sst, bz_hi, bz_lo, key_one):
        """One token tile's scores [16 tokens, 8 heads]: sum_g (ks_g key_one) D_g + kz_g qs_g
        (ks_g: the tile's key scales of group g, [16] fp16 per row; ``sst``: the tile's 16
        ``[ks | kz | vs | vz]`` rows in shared memory: ``sum_g kz_g qs_g`` is their dot with
        :func:`_zero_dot_operands`' B, started from zero)."""
        acc = gl.full([16, 8], 0.0, gl.float32, MMA)
        zrows = sst.load(DA)
        z = mma_v2(zrows, bz_hi, mma_v2(zrows, bz_lo, acc))
        d0 = mma_v2(a0, sq.index(0).load(DB), acc)
        d1 = mma_v2(a1, sq.index(1).load(DB), acc)
        d2 = mma_v2(a2, sq.index(2).load(DB), acc)
        d3 = mma_v2(a3, sq.index(3).load(DB), acc)
        s = z + d0 * (ks0.to(gl.float32) * key_one)[:, None]
        s += d1 * (ks1.to(gl.float32) * key_one)[:, None]
        s += d2 * (ks2.to(gl.float32) * key_one)[:, None]
        s += d3 * (ks3.to(gl.float32) * key_one)[:, None]
        return s

    @gluon.jit
    def _pv_group(p0h, p1h, va, vb, oa, ob, s0, s1):
        """Group g's two channel tiles: oa, ob += codes @ (p * vs_g)^T (s0, s1: the group's
        value scales of tokens 0-15 and 16-31). The block's dot starts from zero and is
        added in fp32 (round to nearest): the tensor cores truncate what they add to their
        accumulator, a bias that would grow with the split."""
        bg = cat_tokens(movmatrix_b(p0h * s0[:, None]), movmatrix_b(p1h * s1[:, None]))
        zero = gl.zeros_like(oa)
        return oa + mma_v2(va, bg, zero), ob + mma_v2(vb, bg, zero)

    @gluon.jit
    def _store_tile4(po_ptr, prow, hmask, o, z, inv, mt: gl.constexpr):
        """Partial output of channel tile mt = 2 g + u: (o 2**24 / 16**u + z_g) / l."""
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        c = 32 * (mt // 2) + 4 * (r % 8) + (mt % 2) + 2 * (r // 8)
        scale: gl.constexpr = 16777216.0 / (16.0 ** (mt % 2))
        val = (o * scale + z[None, :]) * inv[None, :]
        gl.store(po_ptr + prow[None, :] + c[:, None], val, mask=hmask[None, :])

    @gluon.jit
    def int4_split_program(
        h, s, b, q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh, lens2_ptr,
        lens4_ptr, stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh, k_ptr, v_ptr, ks_ptr,
        kz_ptr, vs_ptr, vz_ptr, kcs_ptr, slot_rows4, head_rows4, po_ptr, plse_ptr, qk_scale,
        dead_id, int4_base, Hkv,
        split_len, S_total, s_first,
        G: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, SSTRIDE: gl.constexpr,
        INTERLEAVED: gl.constexpr, HAS_INT2: gl.constexpr, HAS_HEAD_MASK: gl.constexpr,
        HAS_KCS: gl.constexpr, RESCALE_SLACK: gl.constexpr,
    ):  # fmt: skip
        """One INT4 split: positions [n2 + s split_len, n2 + (s + 1) split_len) of request b's
        INT4 segment (``lens2``: where it starts, n2, with HAS_INT2, else 0; ``lens4``: its
        length; per request or per request and KV head), KV head h. Writes the G query heads' partial rows
        ``(b Hq + h G + i) S_total + s_first + s`` of po ([rows, D] fp32, normalised) and
        plse (log2-sum-exp, -inf where nothing was live). The body of
        :func:`int4_split_gluon_kernel` and of the INT4 programs of
        :func:`.decode_mixed_gluon.mixed_split_gluon_kernel`."""
        seg0 = 0
        if HAS_INT2:  # the INT4 segment starts past the INT2 one
            seg0 = gl.load(lens2_ptr + b * stride_lb + h * stride_lh)
        seg = seg0 + gl.load(lens4_ptr + b * stride_lb + h * stride_lh)
        start = seg0 + s * split_len
        end = gl.minimum(start + split_len, seg)
        slot_row = slot_ptr + b.to(gl.int64) * stride_sb + h * stride_sh
        head_row4 = h * head_rows4  # this head's rows: slot * slot_rows4 + head_row4
        hm_row = hm_ptr + b.to(gl.int64) * stride_mb + h * stride_mh
        has_hm = 1 if HAS_HEAD_MASK else 0

        sk = gl.allocate_shared_memory(gl.int16, [NS, 32, D // 4], SHC)
        sv = gl.allocate_shared_memory(gl.int16, [NS, 32, D // 4], SHC)
        # [ks | kz | vs | vz] per row ([vs | vz]: the B operand of the value zeros' dot)
        ss = gl.allocate_shared_memory(gl.float16, [NS, 32, 16], SH2)
        sq = gl.allocate_shared_memory(gl.float16, [4, 32, 8], SH2)
        qs0 = _q_group(q_ptr, stride_qb, stride_qh, kcs_ptr, sq, b, h, qk_scale, G, D, HAS_KCS, 0)  # fmt: skip
        qs1 = _q_group(q_ptr, stride_qb, stride_qh, kcs_ptr, sq, b, h, qk_scale, G, D, HAS_KCS, 1)  # fmt: skip
        qs2 = _q_group(q_ptr, stride_qb, stride_qh, kcs_ptr, sq, b, h, qk_scale, G, D, HAS_KCS, 2)  # fmt: skip
        qs3 = _q_group(q_ptr, stride_qb, stride_qh, kcs_ptr, sq, b, h, qk_scale, G, D, HAS_KCS, 3)  # fmt: skip
        bz_hi, bz_lo = _zero_dot_operands(qs0, qs1, qs2, qs3)

        m_i = gl.full([8], -1.0e30, gl.float32, gl.SliceLayout(0, MMA))
        lsum = gl.full([16, 8], 0.0, gl.float32, MMA)
        zacc = gl.full([16, 8], 0.0, gl.float32, MMA)
        o0 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o1 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o2 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o3 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o4 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o5 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o6 = gl.full([16, 8], 0.0, gl.float32, MMA)
        o7 = gl.full([16, 8], 0.0, gl.float32, MMA)
        key_one = qk_scale * 16777216.0

        n_blocks = gl.cdiv(end - start, 32)
        gl.static_assert((NS == 2) or (NS == 3), "the mask FIFO below holds NS - 1 blocks")
        # prologue: blocks 0 .. NS - 2 in flight; mk0 (, mk1): their live-row masks
        sl = slot_of_lane(slot_row, hm_row, start, end, dead_id, has_hm)
        mk0 = _live_mask(sl, dead_id)
        _issue4(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, ss, 0, sl, dead_id, int4_base, slot_rows4, head_row4, D, SSTRIDE, INTERLEAVED)  # fmt: skip
        if NS == 3:
            sl = slot_of_lane(slot_row, hm_row, start + 32, end, dead_id, has_hm)
            mk1 = _live_mask(sl, dead_id)
            _issue4(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, ss, 1, sl, dead_id, int4_base, slot_rows4, head_row4, D, SSTRIDE, INTERLEAVED)  # fmt: skip
        # the slots of blocks n + NS - 1 and n + NS, read ahead of their use
        sl_a = slot_of_lane(slot_row, hm_row, start + 32 * (NS - 1), end, dead_id, has_hm)
        sl_b = slot_of_lane(slot_row, hm_row, start + 32 * NS, end, dead_id, has_hm)
        for n in range(0, n_blocks):
            cta_barrier()  # every lane is done with the stage the next copy overwrites
            mk_a = _live_mask(sl_a, dead_id)
            _issue4(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, ss, (n + NS - 1) % NS, sl_a, dead_id, int4_base, slot_rows4, head_row4, D, SSTRIDE, INTERLEAVED)  # fmt: skip
            sl_a = sl_b
            sl_b = slot_of_lane(slot_row, hm_row, start + 32 * (n + NS + 1), end, dead_id, has_hm)  # fmt: skip
            _cp.wait_group(NS - 1)
            cta_barrier()
            st = n % NS
            mask = mk0
            if NS == 3:
                mk0 = mk1
                mk1 = mk_a
            else:
                mk0 = mk_a
            a00, a01, a02, a03, a10, a11, a12, a13 = _key_tiles(sk.index(st).load(LK))
            ks00, ks01, ks10, ks11, ks20, ks21, ks30, ks31 = group_scales(
                ss.index(st).slice(0, 4, dim=1).load(LVS)
            )
            s0 = _scores(a00, a01, a02, a03, sq, ks00, ks10, ks20, ks30, ss.index(st).slice(0, 16, dim=0), bz_hi, bz_lo, key_one)  # fmt: skip
            s1 = _scores(a10, a11, a12, a13, sq, ks01, ks11, ks21, ks31, ss.index(st).slice(16, 16, dim=0), bz_hi, bz_lo, key_one)  # fmt: skip
            (p0h, p1h, m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7) = softmax_step(
                s0, s1, mask, m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7, RESCALE_SLACK
            )
            # (from zero and added in fp32, as the value dots: no truncation bias)
            zacc += value_zeros(p0h, p1h, ss.index(st).slice(8, 8, dim=1), gl.zeros_like(zacc))
            vs00, vs01, vs10, vs11, vs20, vs21, vs30, vs31 = group_scales(
                ss.index(st).slice(8, 4, dim=1).load(LVS)
            )
            v00, v01, v10, v11, v20, v21, v30, v31 = _val_tiles(sv.index(st).load(LV))
            o0, o1 = _pv_group(p0h, p1h, v00, v01, o0, o1, vs00, vs01)
            o2, o3 = _pv_group(p0h, p1h, v10, v11, o2, o3, vs10, vs11)
            o4, o5 = _pv_group(p0h, p1h, v20, v21, o4, o5, vs20, vs21)
            o6, o7 = _pv_group(p0h, p1h, v30, v31, o6, o7, vs30, vs31)
        _cp.wait_group(0)
        store_split(
            po_ptr, plse_ptr, b * (Hkv * G) + h * G, s_first + s, S_total, G, D,
            m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7, _store_tile4,
        )  # fmt: skip

    @gluon.jit
    def int4_split_gluon_kernel(
        q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh, lens2_ptr, lens4_ptr,
        stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh, k_ptr, v_ptr, ks_ptr, kz_ptr,
        vs_ptr, vz_ptr, kcs_ptr, slot_rows4, head_rows4, po_ptr, plse_ptr, qk_scale, dead_id,
        int4_base, Hkv,
        split_len, S_total, s_first,
        G: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, SSTRIDE: gl.constexpr,
        INTERLEAVED: gl.constexpr, HAS_INT2: gl.constexpr, HAS_HEAD_MASK: gl.constexpr, HAS_KCS: gl.constexpr, RESCALE_SLACK: gl.constexpr,
        LAUNCH_DEPENDENTS: gl.constexpr = False, WAIT_PRIOR: gl.constexpr = False,
    ):  # fmt: skip
        """:func:`int4_split_program` of KV head, split and request ``program_id(0, 1, 2)``.
        LAUNCH_DEPENDENTS / WAIT_PRIOR: the launch chain's programmatic dependencies
        (:func:`.decode_attention.launch_chain`: ``griddepcontrol.launch_dependents`` at the
        start, ``griddepcontrol.wait`` at the end)."""
        if LAUNCH_DEPENDENTS:  # the next launch (a programmatic dependent) may start
            gdc_launch_dependents()
        int4_split_program(
            gl.program_id(0), gl.program_id(1), gl.program_id(2), q_ptr, stride_qb, stride_qh,
            slot_ptr, stride_sb, stride_sh, lens2_ptr, lens4_ptr, stride_lb, stride_lh, hm_ptr,
            stride_mb, stride_mh, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, kcs_ptr,
            slot_rows4, head_rows4, po_ptr, plse_ptr, qk_scale, dead_id, int4_base, Hkv,
            split_len, S_total, s_first, G, D, NS,
            SSTRIDE, INTERLEAVED, HAS_INT2, HAS_HEAD_MASK, HAS_KCS, RESCALE_SLACK,
        )  # fmt: skip
        if WAIT_PRIOR:  # a programmatic dependent: complete only after the previous grid
            gdc_wait()

else:
    int4_split_gluon_kernel = int4_split_program = None


def int4_pool_args(int4) -> tuple:
    """The INT4 pool's launch arguments (``int4``: the :class:`~.pools.Int4Pool`): key and
    value codes, key scales and zeros, value scales and zeros, the per-channel key scale
    (the key scales stand in where the pool has none; read only with ``HAS_KCS``), and the
    rows' slot and head strides (its :meth:`~.pools.Int4Pool.row_map`, read once per pool)."""
    kcs = int4.k_channel if int4.k_channel is not None else int4.k_scale
    rows = int4.row_map()
    return (
        *(int4.k, int4.v, int4.k_scale, int4.k_zero, int4.v_scale, int4.v_zero, kcs),
        rows.slot_rows,
        rows.head_rows,
    )


def int4_split_gluon_args(
    q: torch.Tensor,
    slot_map: torch.Tensor,
    int2_lens: torch.Tensor,
    int4_lens: torch.Tensor,
    stride_lb: int,
    stride_lh: int,
    head_mask: torch.Tensor | None,
    int4,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    qk_scale: float,
    dead_id: int,
    int4_base: int,
    split_len: int,
    s_total: int,
    s_first: int,
) -> tuple:
    """The kernel's positional arguments (``slot_map`` [B, L] or [B, Hkv, L]; ``head_mask``
    None or uint8 [B, Hkv, L]; ``int4``: the :class:`~.pools.Int4Pool`; ``int2_lens``:
    where each INT4 segment starts, read only with the constexpr ``HAS_INT2``)."""
    return (
        *query_slot_args(q, slot_map),
        int2_lens,
        int4_lens,
        stride_lb,
        stride_lh,
        *head_mask_args(head_mask, slot_map),
        *int4_pool_args(int4),
        part_o,
        part_lse,
        qk_scale,
        dead_id,
        int4_base,
        int4.k.shape[1],
        split_len,
        s_total,
        s_first,
    )


def int4_split_gluon_consts(
    group: int,
    head_dim: int,
    scale_stride: int,
    interleaved: bool,
    has_int2: bool,
    has_head_mask: bool,
    has_key_channel_scale: bool,
    max_registers: int | None = None,
    stages: int = STAGES,
    launch_dependents: bool = False,
    wait_prior: bool = False,
) -> dict:
    """Constexprs and launch options of the kernel (``launch_dependents`` / ``wait_prior``:
    its place in a programmatic launch chain, see :func:`.decode_attention.launch_chain`;
    ``stages``: cp.async stages, 2 or 3, the
    blocks in flight plus the one in compute; ``scale_stride``: elements between one
    (slot, head) row's scales and the next's; ``interleaved``: each row's scales and zeros
    side by side, ``[ks | kz | vs | vz]`` at ``k_scale``; ``has_int2``: the launch has
    INT2 segments, ``int2_lens`` says where each INT4 segment starts, else at 0;
    ``max_registers``: None = :data:`MAX_REGISTERS`). The softmax's running max moves
    whenever a head's max grows (``RESCALE_SLACK`` 0: the dominant token's ``p`` and
    ``p * vs`` exact, as the INT2 split's default)."""
    return dict(
        G=group,
        D=head_dim,
        NS=stages,
        SSTRIDE=scale_stride,
        INTERLEAVED=interleaved,
        HAS_INT2=has_int2,
        HAS_HEAD_MASK=has_head_mask,
        HAS_KCS=has_key_channel_scale,
        RESCALE_SLACK=0.0,
        LAUNCH_DEPENDENTS=launch_dependents,
        WAIT_PRIOR=wait_prior,
        num_warps=1,
        maxnreg=max_registers or MAX_REGISTERS,
    )


__all__ = [
    "MAX_REGISTERS",
    "STAGES",
    "int4_pool_args",
    "int4_split_gluon_args",
    "int4_split_gluon_consts",
    "int4_split_gluon_kernel",
    "int4_split_program",
]
