"""The INT2 decode split as a Gluon kernel with explicit register layouts (issue 10).

Same contract, same math and the same partial outputs as the folded INT2 split of
:mod:`.decode_attention` (keys ``(q * ks) . code + q . kz`` per page, values
``sum_t (p_t vs_tg) code_t + sum_t p_t vz_tg``, codes entering the tensor cores as exact fp16
subnormals), for the INT2 segment's splits (head_dim 128, a GQA group of at most 8; the
other segments of a launch run on that module's kernel). What Triton's layout inference
could not give, Gluon's explicit layouts do:

* **Swapped operands.** Scores are ``S^T = codes @ (q * ks)^T`` (tokens as the 16 MMA rows,
  the GQA group padded to 8 columns, not 16 rows) and values ``O^T = codes^T @ (p * vs)^T``
  (channels as rows): half the MMAs of the row-padded form.
* **Codes made in the operand layout.** Each thread loads exactly the code words its MMA
  fragments hold (``LKW`` / ``LVW``) and turns them into fp16 subnormals in place (a byte
  permute and one ``and`` per pair of codes); the reshapes and permutes that follow only
  rename registers (every ``convert_layout`` here is asserted trivial). The key channels
  enter the dot in a permuted order (``k`` below) that the query and the page scales follow.
* **Scores to the value operand in registers.** ``movmatrix`` transposes each 8 x 8 block of
  the fp16 ``p`` (the score tile's accumulator layout) into the value dot's B operand.
* **The page's live rows from one reduction.** Lane ``l`` reads position ``l``'s slot;
  ``redux.sync`` ORs the live rows into a 32-bit mask and takes the page. The block's rows
  (page-contiguous: 1 KiB of key codes, 1 KiB of value codes) are copied to shared memory
  with ``cp.async`` (``NS`` stages, rows that no position maps to are not read), and the
  slot map is read ``NS - 1`` and ``NS`` blocks ahead of its use.
* **Zeros by the tensor cores.** ``q . kz`` is one more dot (the page's zeros as 16 equal
  rows against the query), added to the scores after their dot; ``sum p vz`` is a dot of
  ``p`` (the heads as rows) against the block's ``[vs | vz]`` rows.
* **16 programs per SM.** The query waits in shared memory (two ``ldmatrix`` per block) and
  ``maxnreg`` is 128, without spills.

One warp per program, grid (KV head, split, request) like the Triton split. Triton's
interpreter does not run Gluon: the CPU tests run the Triton split, this kernel is tested
against the torch reference on a GPU (``tests/kernels/test_decode_int2_gluon.py``) and
compiled for sm_90 on the CPU (``tests/bench/test_decode_sass.py``).
"""

from __future__ import annotations

import torch

from .gluon_fragments import GLUON_AVAILABLE, head_mask_args, query_slot_args
from .packing import INT2_WORD_PLANES

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
        store_split,
        value_zeros,
    )

#: cp.async stages: one block in compute, one in flight (H200, session 22, split kernel vs 3
#: stages: B=1 N=32k -17%, B=32 N=32k -3.5%, B=8 N=128k -2%, B=8 N=32k and B=32 N=4k within
#: noise; 16 fewer instructions per block, 10 instead of 13 KiB; 4 stages were 6-15% slower)
STAGES = 2
#: registers per thread: 128 (no spills on sm_90) lets an SM hold 16 one-warp programs
#: (shared memory: 10 KiB each) where the compiler's 158 would give 12
MAX_REGISTERS = 128

if GLUON_AVAILABLE:
    # Lane (gid, tig) = (lane // 4, lane % 4), the MMA fragments' coordinates.
    # key half-words [32 tokens, 16]: tokens gid + 8 j, half-words 4 tig + 2 wsel + e
    LKW = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=[],
        block_bases=[],
        shape=[32, 16],
    )
    # value words [32 tokens, 8]: word gid of tokens 2 tig + e + 8 hf + 16 kt
    LVW = gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [8, 0], [16, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[],
        block_bases=[],
        shape=[32, 8],
    )
    # the page's key scales [128 channels] in channel order: channels 8 tig + [0, 8) + 32 plane
    LKS = gl.DistributedLinearLayout(
        reg_bases=[[1], [2], [4], [32], [64]],
        lane_bases=[[8], [16], [0], [0], [0]],
        warp_bases=[],
        block_bases=[],
        shape=[128],
    )
    # cp.async tiles: 16-byte copies of code rows, 8-byte value-scale rows, 8-byte scale runs
    CK = gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0])  # [32, 16] int16
    CV = gl.BlockedLayout([1, 4], [16, 2], [1, 1], [1, 0])  # [32, 8] int32
    CS = gl.BlockedLayout([1, 4], [32, 1], [1, 1], [1, 0])  # [32, 4] fp16
    CP = gl.BlockedLayout([4], [32], [1], [0])  # [128] fp16
    SH1 = gl.SwizzledSharedLayout(1, 1, 1, order=[0])

    # Key words (two int16 elements a, b of one 32-bit word): output x*4 + k holds, as fp16
    # subnormals left in place ((n << 2k) 2**-24), bit pair k of byte 2x (low half) and of
    # byte 2x + 1 (high half): channels 4 w + 2 x + e + 32 k.
    KEY_ASM = gl.constexpr(
        """{
.reg .b32 t, u;
prmt.b32 u, $8, 0, 0x4140;
prmt.b32 t, $8, 0, 0x4342;
and.b32 $0, u, 0x00030003;
and.b32 $1, u, 0x000C000C;
and.b32 $2, u, 0x00300030;
and.b32 $3, u, 0x00C000C0;
and.b32 $4, t, 0x00030003;
and.b32 $5, t, 0x000C000C;
and.b32 $6, t, 0x00300030;
and.b32 $7, t, 0x00C000C0;
}"""
    )

    # value words: one word of two consecutive tokens -> output 4 i + k: bit pair k of byte i
    # of each (the first token in the low half), left in place (the Triton split's asm)
    VAL_ASM = gl.constexpr(INT2_WORD_PLANES.value)

    # (live rows: bit r set where a position maps to page row r, the page) of one block
    MASK_ASM = gl.constexpr(
        """{
.reg .s32 j, b, pg;
.reg .pred p;
setp.ne.s32 p, $2, $3;
sub.s32 j, $2, $4;
and.b32 b, j, 31;
shl.b32 b, 1, b;
selp.b32 b, b, 0, p;
shr.s32 pg, j, 5;
selp.b32 pg, pg, -1, p;
redux.sync.or.b32 $0, b, 0xffffffff;
redux.sync.max.s32 $1, pg, 0xffffffff;
}"""
    )

    @gluon.jit
    def _mask_page(slot, dead_id, int2_base):
        return gl.inline_asm_elementwise(
            MASK_ASM,
            "=r,=r,r,r,r",
            [slot, dead_id, int2_base],
            dtype=(gl.int32, gl.int32),
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _issue(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, sks, skz, svsz, st, mask,
               page, Hkv, h, D: gl.constexpr):  # fmt: skip
        """cp.async one block's live page rows and the page's key scales into stage ``st``
        (one commit group)."""
        ph = (gl.maximum(page, 0) * Hkv + h).to(gl.int64)  # the page's row of this head
        rk = gl.arange(0, 32, layout=gl.SliceLayout(1, CK))
        ck = gl.arange(0, 16, layout=gl.SliceLayout(0, CK))
        kp = k_ptr.to(gl.pointer_type(gl.int16)) + ph * (4 * D) + rk[:, None] * (D // 8)
        cp_load(sk.index(st), kp + ck[None, :], mask=(((mask >> rk) & 1) != 0)[:, None])
        rv = gl.arange(0, 32, layout=gl.SliceLayout(1, CV))
        cv = gl.arange(0, 8, layout=gl.SliceLayout(0, CV))
        vp = v_ptr.to(gl.pointer_type(gl.int32)) + ph * (2 * D) + rv[:, None] * (D // 16)
        cp_load(sv.index(st), vp + cv[None, :], mask=(((mask >> rv) & 1) != 0)[:, None])
        rs = gl.arange(0, 32, layout=gl.SliceLayout(1, CS))
        cs = gl.arange(0, 4, layout=gl.SliceLayout(0, CS))
        so = ph * D + rs[:, None] * (D // 32) + cs[None, :]
        ls = (((mask >> rs) & 1) != 0)[:, None]
        cp_load(svsz.index(st).slice(0, 4, dim=1), vs_ptr + so, mask=ls)
        cp_load(svsz.index(st).slice(4, 4, dim=1), vz_ptr + so, mask=ls)
        cc = gl.arange(0, D, layout=CP)
        lp = (cc >= 0) & (mask != 0)
        cp_load(sks.index(st), ks_ptr + ph * D + cc, mask=lp)
        cp_load(skz.index(st), kz_ptr + ph * D + cc, mask=lp)
        _cp.commit_group()

    @gluon.jit
    def _k_order(x):
        """[128] channel order ``c = 32 k + 8 tig + 4 wsel + 2 x + e`` -> the key dot's order
        ``32 k + 16 wsel + 8 x + 2 tig + e`` (a register renaming)."""
        x = gl.reshape(x, [4, 4, 2, 2, 2])
        return gl.reshape(gl.permute(x, (0, 2, 3, 1, 4)), [128])

    @gluon.jit
    def _key_tiles(kw):
        """[32, 16] int16 key half-words (LKW) -> the A tiles [16 tokens, 128] of tokens 0-15
        and 16-31, channels in the key dot's order."""
        o00, o01, o02, o03, o10, o11, o12, o13 = gl.inline_asm_elementwise(
            KEY_ASM, "=r," * 8 + "r", [kw], dtype=(gl.float16,) * 8, is_pure=True, pack=2
        )
        b0 = gl.join(gl.join(o00, o01), gl.join(o02, o03))  # t, hw, k0, k1
        b1 = gl.join(gl.join(o10, o11), gl.join(o12, o13))
        x = gl.reshape(gl.join(b0, b1), [32, 4, 2, 2, 2, 2, 2])  # t, tig, wsel, e, k0, k1, x
        x = gl.permute(x, (0, 5, 4, 2, 6, 1, 3))  # t, k1, k0, wsel, x, tig, e
        a0, a1 = gl.split(gl.permute(gl.reshape(x, [2, 16, 128]), (1, 2, 0)))
        return (
            gl.convert_layout(a0, DA, assert_trivial=True),
            gl.convert_layout(a1, DA, assert_trivial=True),
        )

    @gluon.jit
    def _val_tile(oa, ob):
        """Two [32 t, 8 w] code tensors (bytes i, i + 1 of one plane) -> A tile [16, 32]:
        row ``8 j + w`` is channel ``32 k + 4 w + i + j``."""
        x = gl.reshape(gl.permute(gl.join(oa, ob), (2, 1, 0)), [16, 32])
        return gl.convert_layout(x, DA, assert_trivial=True)

    @gluon.jit
    def _pv_plane(p0h, p1h, va, vb, vc, vd, oa, ob, s0, s1):
        """One plane's two channel tiles: oa, ob += codes @ (p * vs)^T (s0, s1: the group's
        value scales of tokens 0-15 and 16-31)."""
        bg = cat_tokens(movmatrix_b(p0h * s0[:, None]), movmatrix_b(p1h * s1[:, None]))
        oa = mma_v2(_val_tile(va, vb), bg, oa)
        ob = mma_v2(_val_tile(vc, vd), bg, ob)
        return oa, ob

    @gluon.jit
    def _store_tile(po_ptr, prow, hmask, o, z, inv, mt: gl.constexpr):
        """Partial output of channel tile mt (plane mt // 2): (o 2**(24 - 2k) + z) / l."""
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
        c = 32 * (mt // 2) + 4 * (r % 8) + 2 * (mt % 2) + r // 8
        scale: gl.constexpr = 16777216.0 / (4.0 ** (mt // 2))
        val = (o * scale + z[None, :]) * inv[None, :]
        gl.store(po_ptr + prow[None, :] + c[:, None], val, mask=hmask[None, :])

    @gluon.jit
    def int2_split_program(
        h, s, b, q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh, lens_ptr,
        stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr,
        vz_ptr, po_ptr, plse_ptr, qk_scale, dead_id, int2_base, Hkv, split_len, S_total,
        G: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, HAS_HEAD_MASK: gl.constexpr,
        RESCALE_SLACK: gl.constexpr,
    ):  # fmt: skip
        """One INT2 split: positions [s split_len, (s + 1) split_len) of the INT2 segment
        (``lens``: its length per request, or per request and KV head) of request b, KV head
        h. Writes the G query heads' partial rows ``(b Hq + h G + i) S_total + s`` of po
        ([rows, D] fp32, normalised) and plse (log2-sum-exp, -inf where nothing was live).
        The body of :func:`int2_split_gluon_kernel` and of the INT2 programs of
        :func:`.decode_mixed_gluon.mixed_split_gluon_kernel`."""
        seg = gl.load(lens_ptr + b * stride_lb + h * stride_lh)
        start = s * split_len
        end = gl.minimum(start + split_len, seg)
        slot_row = slot_ptr + b.to(gl.int64) * stride_sb + h * stride_sh
        hm_row = hm_ptr + b.to(gl.int64) * stride_mb + h * stride_mh
        has_hm = 1 if HAS_HEAD_MASK else 0

        sk = gl.allocate_shared_memory(gl.int16, [NS, 32, 16], SH2)
        sv = gl.allocate_shared_memory(gl.int32, [NS, 32, 8], SH2)
        # [vs | vz] per row: the B operand of the zero dot
        svsz = gl.allocate_shared_memory(gl.float16, [NS, 32, 8], SH2)
        sks = gl.allocate_shared_memory(gl.float16, [NS, 128], SH1)
        skz = gl.allocate_shared_memory(gl.float16, [NS, 128], SH1)

        # the query as the key dot's B operand [128 (dot order), 8]: qf with plane k's
        # 2**-2k folded in (the key codes stay in place), qu plain (for q . kz)
        kk = gl.arange(0, 128, layout=gl.SliceLayout(1, DB))
        hh = gl.arange(0, 8, layout=gl.SliceLayout(0, DB))
        plane = kk // 32
        cc = 32 * plane + 8 * ((kk // 2) % 4) + 4 * ((kk // 16) % 2) + 2 * ((kk // 8) % 2)
        cc = cc + kk % 2
        qp = q_ptr + b * stride_qb + (h * G + hh)[None, :] * stride_qh + cc[:, None]
        qv = gl.load(qp, mask=(hh < G)[None, :], other=0.0).to(gl.float32)
        pf = gl.where(plane == 0, 1.0, gl.where(plane == 1, 0.25, gl.where(plane == 2, 0.0625, 0.015625)))  # fmt: skip
        # kept in shared memory (two ldmatrix per block), not in 32 registers
        sq = gl.allocate_shared_memory(gl.float16, [2, 128, 8], SH2)
        sq.index(0).store((qv * pf[:, None]).to(gl.float16))
        sq.index(1).store(qv.to(gl.float16))

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
        mk0, pg = _mask_page(sl, dead_id, int2_base)
        _issue(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, sks, skz, svsz, 0, mk0, pg, Hkv, h, D)  # fmt: skip
        if NS == 3:
            sl = slot_of_lane(slot_row, hm_row, start + 32, end, dead_id, has_hm)
            mk1, pg = _mask_page(sl, dead_id, int2_base)
            _issue(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, sks, skz, svsz, 1, mk1, pg, Hkv, h, D)  # fmt: skip
        # the slots of blocks n + NS - 1 and n + NS, read ahead of their use
        sl_a = slot_of_lane(slot_row, hm_row, start + 32 * (NS - 1), end, dead_id, has_hm)
        sl_b = slot_of_lane(slot_row, hm_row, start + 32 * NS, end, dead_id, has_hm)
        for n in range(0, n_blocks):
            cta_barrier()  # every lane is done with the stage the next copy overwrites
            mk_a, pg_a = _mask_page(sl_a, dead_id, int2_base)
            _issue(k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, sk, sv, sks, skz, svsz, (n + NS - 1) % NS, mk_a, pg_a, Hkv, h, D)  # fmt: skip
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
            # scores of tokens 0-15 and 16-31 for the 8 (padded) query heads, plus q . kz (all
            # 16 rows of that product are equal)
            a0, a1 = _key_tiles(sk.index(st).load(LKW))
            ks = _k_order(sks.index(st).load(LKS))
            kz = _k_order(skz.index(st).load(LKS))
            ks = gl.convert_layout(ks, gl.SliceLayout(1, DB), assert_trivial=True)
            kz = gl.convert_layout(kz, gl.SliceLayout(0, DA), assert_trivial=True)
            bk = sq.index(0).load(DB) * ks[:, None]
            kza = gl.broadcast(kz[None, :], a0)[0]
            # (added after the code dots, not as their seed: q . kz can dwarf them, and the
            # tensor cores truncate each product they add to a large accumulator)
            acc0 = gl.full([16, 8], 0.0, gl.float32, MMA)
            qz = mma_v2(kza, sq.index(1).load(DB), acc0) * qk_scale
            s0 = mma_v2(a0, bk, acc0) * key_one + qz
            s1 = mma_v2(a1, bk, acc0) * key_one + qz
            (p0h, p1h, m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7) = softmax_step(
                s0, s1, mask, m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7, RESCALE_SLACK
            )
            zacc = value_zeros(p0h, p1h, svsz.index(st), zacc)
            # values: plane k (channels 32k..32k+31, value group k) in two channel tiles
            g00, g01, g10, g11, g20, g21, g30, g31 = group_scales(
                svsz.index(st).slice(0, 4, dim=1).load(LVS)
            )
            (w00, w01, w02, w03, w10, w11, w12, w13, w20, w21, w22, w23, w30, w31, w32, w33) = (
                gl.inline_asm_elementwise(
                    VAL_ASM,
                    "=r," * 16 + "r,r",
                    [sv.index(st).load(LVW)],
                    dtype=(gl.float16,) * 16,
                    is_pure=True,
                    pack=2,
                )
            )
            o0, o1 = _pv_plane(p0h, p1h, w00, w10, w20, w30, o0, o1, g00, g01)
            o2, o3 = _pv_plane(p0h, p1h, w01, w11, w21, w31, o2, o3, g10, g11)
            o4, o5 = _pv_plane(p0h, p1h, w02, w12, w22, w32, o4, o5, g20, g21)
            o6, o7 = _pv_plane(p0h, p1h, w03, w13, w23, w33, o6, o7, g30, g31)
        _cp.wait_group(0)
        store_split(
            po_ptr, plse_ptr, b * (Hkv * G) + h * G, s, S_total, G, D,
            m_i, lsum, zacc, o0, o1, o2, o3, o4, o5, o6, o7, _store_tile,
        )  # fmt: skip

    @gluon.jit
    def int2_split_gluon_kernel(
        q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh, lens_ptr, stride_lb,
        stride_lh, hm_ptr, stride_mb, stride_mh, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
        po_ptr, plse_ptr, qk_scale, dead_id, int2_base, Hkv, split_len, S_total,
        G: gl.constexpr, D: gl.constexpr, NS: gl.constexpr, HAS_HEAD_MASK: gl.constexpr,
        RESCALE_SLACK: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr = False,
        WAIT_PRIOR: gl.constexpr = False,
    ):  # fmt: skip
        """:func:`int2_split_program` of KV head, split and request ``program_id(0, 1, 2)``.
        LAUNCH_DEPENDENTS / WAIT_PRIOR: the launch chain's programmatic dependencies
        (:func:`.decode_attention.launch_chain`: ``griddepcontrol.launch_dependents`` at the
        start, ``griddepcontrol.wait`` at the end)."""
        if LAUNCH_DEPENDENTS:  # the next launch (a programmatic dependent) may start
            gdc_launch_dependents()
        int2_split_program(
            gl.program_id(0), gl.program_id(1), gl.program_id(2), q_ptr, stride_qb, stride_qh,
            slot_ptr, stride_sb, stride_sh, lens_ptr, stride_lb, stride_lh, hm_ptr, stride_mb,
            stride_mh, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, po_ptr, plse_ptr, qk_scale,
            dead_id, int2_base, Hkv, split_len, S_total, G, D, NS, HAS_HEAD_MASK, RESCALE_SLACK,
        )  # fmt: skip
        if WAIT_PRIOR:  # a programmatic dependent: complete only after the previous grid
            gdc_wait()

else:
    int2_split_gluon_kernel = int2_split_program = None


def int2_pool_args(int2) -> tuple:
    """The INT2 pool's launch arguments (``int2``: the :class:`~.pools.Int2Pool`): key and
    value code pages, key scales and zeros, value scales and zeros."""
    return int2.k, int2.v, int2.k_scale, int2.k_zero, int2.v_scale, int2.v_zero


def int2_split_gluon_args(
    q: torch.Tensor,
    slot_map: torch.Tensor,
    int2_lens: torch.Tensor,
    stride_lb: int,
    stride_lh: int,
    head_mask: torch.Tensor | None,
    int2,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    qk_scale: float,
    dead_id: int,
    int2_base: int,
    split_len: int,
    s_total: int,
) -> tuple:
    """The kernel's positional arguments (``slot_map`` [B, L] or [B, Hkv, L]; ``head_mask``
    None or uint8 [B, Hkv, L]; ``int2``: the :class:`~.pools.Int2Pool`)."""
    return (
        *query_slot_args(q, slot_map),
        int2_lens,
        stride_lb,
        stride_lh,
        *head_mask_args(head_mask, slot_map),
        *int2_pool_args(int2),
        part_o,
        part_lse,
        qk_scale,
        dead_id,
        int2_base,
        int2.k.shape[1],
        split_len,
        s_total,
    )


def int2_split_gluon_consts(
    group: int,
    head_dim: int,
    has_head_mask: bool,
    max_registers: int | None = None,
    lazy_rescale: bool = False,
    stages: int = STAGES,
    launch_dependents: bool = False,
    wait_prior: bool = False,
) -> dict:
    """Constexprs and launch options of the kernel (``max_registers``: None =
    :data:`MAX_REGISTERS`; ``lazy_rescale``: the running max moves only by more than 2**4;
    ``stages``: cp.async stages, 2 or 3, the blocks in flight plus the one in compute;
    ``launch_dependents`` / ``wait_prior``: its place in a programmatic launch chain, see
    :func:`.decode_attention.launch_chain`)."""
    return dict(
        G=group,
        D=head_dim,
        NS=stages,
        HAS_HEAD_MASK=has_head_mask,
        RESCALE_SLACK=4.0 if lazy_rescale else 0.0,
        LAUNCH_DEPENDENTS=launch_dependents,
        WAIT_PRIOR=wait_prior,
        num_warps=1,
        maxnreg=max_registers or MAX_REGISTERS,
    )


__all__ = [
    "MAX_REGISTERS",
    "STAGES",
    "int2_pool_args",
    "int2_split_gluon_args",
    "int2_split_gluon_consts",
    "int2_split_gluon_kernel",
    "int2_split_program",
]
