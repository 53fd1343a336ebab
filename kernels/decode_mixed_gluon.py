"""The INT2 and the INT4 decode splits of a mixed launch as one Gluon kernel (issue 10).

A mixed request (its oldest positions in INT2 pages, then an INT4 segment) used to take two
split launches, :mod:`.decode_int2_gluon`'s and :mod:`.decode_int4_gluon`'s, one after the
other. Where a call is small (one or a few requests) neither grid fills the GPU, and each
launch still pays its own latency: launch, ramp-up, tail. This kernel runs both splits'
programs in one grid, ``(KV head, s2 + s4 splits, request)``: program ``(h, y, b)`` runs INT2
split ``y`` when ``y < s2``, else INT4 split ``y - s2``, with the very code of the two kernels
(:func:`.decode_int2_gluon.int2_split_program`, :func:`.decode_int4_gluon.int4_split_program`)
and the same partial rows (INT4 splits at columns ``s2 ..`` of the partial output, as the
INT4 kernel's ``s_first = s2``), so the merge is unchanged and the output is bit-identical
to the two launches'.

One warp per program; registers are capped at 128 like both kernels; shared memory is the
larger of the two bodies' (the compiler gives both branches the same buffers: 17,408 bytes
at the INT4 split's 3 stages, 12 programs per SM, where the INT2 split alone fits 16).
:func:`.decode_attention.decode_attention` uses it wherever both Gluon splits run
(``DecodeConfig.mixed_gluon_fused``; H200, session 25: 4-42% faster than the two launches
at every shape measured, from one request of 4k positions to B=32 N=128k). Tested on a GPU against the two launches
(``tests/kernels/test_decode_int4_gluon.py``) and compiled for sm_90 on the CPU
(``tests/bench/test_decode_sass.py``).
"""

from __future__ import annotations

import torch

from .decode_int2_gluon import STAGES as INT2_STAGES
from .decode_int2_gluon import int2_pool_args, int2_split_gluon_consts
from .decode_int4_gluon import STAGES as INT4_STAGES
from .decode_int4_gluon import int4_pool_args, int4_split_gluon_consts
from .gluon_fragments import GLUON_AVAILABLE, head_mask_args, query_slot_args

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from .decode_int2_gluon import int2_split_program
    from .decode_int4_gluon import int4_split_program

    @gluon.jit
    def mixed_split_gluon_kernel(
        q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh, lens2_ptr, lens4_ptr,
        stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh,
        k2_ptr, v2_ptr, ks2_ptr, kz2_ptr, vs2_ptr, vz2_ptr,
        k4_ptr, v4_ptr, ks4_ptr, kz4_ptr, vs4_ptr, vz4_ptr, kcs_ptr, slot_rows4, head_rows4,
        po_ptr, plse_ptr, qk_scale, dead_id, int2_base, int4_base, Hkv, split_len2, split_len4,
        S_total, s2,
        G: gl.constexpr, D: gl.constexpr, NS2: gl.constexpr, NS4: gl.constexpr,
        SSTRIDE: gl.constexpr, INTERLEAVED: gl.constexpr, HAS_HEAD_MASK: gl.constexpr,
        HAS_KCS: gl.constexpr, RESCALE_SLACK2: gl.constexpr, RESCALE_SLACK4: gl.constexpr,
        LAUNCH_DEPENDENTS: gl.constexpr = False, WAIT_PRIOR: gl.constexpr = False,
    ):  # fmt: skip
        """Program ``(h, y, b)``: INT2 split ``y`` of request b, KV head h, for ``y < s2``
        (``lens2``: the INT2 segment's lengths, split_len2 positions per split), else INT4
        split ``y - s2`` (starting past the INT2 segment, ``lens4`` long, split_len4 per
        split), its partial rows at column ``y``. LAUNCH_DEPENDENTS / WAIT_PRIOR: the launch
        chain's programmatic dependencies (:func:`.decode_attention.launch_chain`)."""
        if LAUNCH_DEPENDENTS:  # the next launch (a programmatic dependent) may start
            gdc_launch_dependents()
        h = gl.program_id(0)
        y = gl.program_id(1)
        b = gl.program_id(2)
        if y < s2:
            int2_split_program(
                h, y, b, q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh,
                lens2_ptr, stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh, k2_ptr, v2_ptr,
                ks2_ptr, kz2_ptr, vs2_ptr, vz2_ptr, po_ptr, plse_ptr, qk_scale, dead_id,
                int2_base, Hkv, split_len2, S_total, G, D, NS2, HAS_HEAD_MASK, RESCALE_SLACK2,
            )  # fmt: skip
        else:
            int4_split_program(
                h, y - s2, b, q_ptr, stride_qb, stride_qh, slot_ptr, stride_sb, stride_sh,
                lens2_ptr, lens4_ptr, stride_lb, stride_lh, hm_ptr, stride_mb, stride_mh,
                k4_ptr, v4_ptr, ks4_ptr, kz4_ptr, vs4_ptr, vz4_ptr, kcs_ptr, slot_rows4,
                head_rows4, po_ptr, plse_ptr,
                qk_scale, dead_id, int4_base, Hkv, split_len4, S_total, s2, G, D, NS4,
                SSTRIDE, INTERLEAVED, True, HAS_HEAD_MASK, HAS_KCS, RESCALE_SLACK4,
            )  # fmt: skip
        if WAIT_PRIOR:  # a programmatic dependent: complete only after the previous grid
            gdc_wait()

else:
    mixed_split_gluon_kernel = None


def mixed_split_gluon_args(
    q: torch.Tensor,
    slot_map: torch.Tensor,
    int2_lens: torch.Tensor,
    int4_lens: torch.Tensor,
    stride_lb: int,
    stride_lh: int,
    head_mask: torch.Tensor | None,
    int2,
    int4,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    qk_scale: float,
    dead_id: int,
    int2_base: int,
    int4_base: int,
    split_len2: int,
    split_len4: int,
    s_total: int,
    s2: int,
) -> tuple:
    """The kernel's positional arguments (``slot_map`` [B, L] or [B, Hkv, L]; ``head_mask``
    None or uint8 [B, Hkv, L]; ``int2`` / ``int4``: the :class:`~.pools.Int2Pool` and
    :class:`~.pools.Int4Pool`; ``s2``: the INT2 splits per (request, KV head), the grid's
    first ``s2`` columns)."""
    return (
        *query_slot_args(q, slot_map),
        int2_lens,
        int4_lens,
        stride_lb,
        stride_lh,
        *head_mask_args(head_mask, slot_map),
        *int2_pool_args(int2),
        *int4_pool_args(int4),
        part_o,
        part_lse,
        qk_scale,
        dead_id,
        int2_base,
        int4_base,
        int4.k.shape[1],
        split_len2,
        split_len4,
        s_total,
        s2,
    )


def mixed_split_gluon_consts(
    group: int,
    head_dim: int,
    scale_stride: int,
    interleaved: bool,
    has_head_mask: bool,
    has_key_channel_scale: bool,
    max_registers: int | None = None,
    int2_lazy_rescale: bool = False,
    int2_stages: int = INT2_STAGES,
    int4_stages: int = INT4_STAGES,
    launch_dependents: bool = False,
    wait_prior: bool = False,
) -> dict:
    """Constexprs and launch options of the kernel, taken from
    :func:`.decode_int2_gluon.int2_split_gluon_consts` and
    :func:`.decode_int4_gluon.int4_split_gluon_consts` for the same launch (the INT2 body's
    stages and rescale slack, the INT4 body's stages, slack and scale layout; registers: the
    larger of the two caps)."""
    c2 = int2_split_gluon_consts(
        group, head_dim, has_head_mask, max_registers, int2_lazy_rescale, int2_stages
    )
    c4 = int4_split_gluon_consts(
        group, head_dim, scale_stride, interleaved, True, has_head_mask,
        has_key_channel_scale, max_registers, int4_stages,
    )  # fmt: skip
    return dict(
        G=group,
        D=head_dim,
        NS2=c2["NS"],
        NS4=c4["NS"],
        SSTRIDE=c4["SSTRIDE"],
        INTERLEAVED=c4["INTERLEAVED"],
        HAS_HEAD_MASK=has_head_mask,
        HAS_KCS=c4["HAS_KCS"],
        RESCALE_SLACK2=c2["RESCALE_SLACK"],
        RESCALE_SLACK4=c4["RESCALE_SLACK"],
        LAUNCH_DEPENDENTS=launch_dependents,
        WAIT_PRIOR=wait_prior,
        num_warps=1,
        maxnreg=max(c2["maxnreg"], c4["maxnreg"]),
    )


__all__ = ["mixed_split_gluon_args", "mixed_split_gluon_consts", "mixed_split_gluon_kernel"]
