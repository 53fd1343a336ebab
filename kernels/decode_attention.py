"""Fused mixed-precision, dead-slot-aware flash-decoding attention (Triton).

Input contract (one layer, one new query token per request):

* ``slot_map[b, :seq_lens[b]]`` lists the request's unified slot ids (:mod:`pools`) in
  three precision-homogeneous segments: positions ``[0, int2_lens[b])`` are INT2 rows,
  ``[int2_lens[b], int2_lens[b] + int4_lens[b])`` INT4 rows, the rest full-precision rows.
  Any position may instead hold ``dead_id`` (evicted): it is masked by id, never read.
* The INT2 segment is whole pages: ``int2_lens[b]`` is a multiple of 32 and each aligned
  group of 32 positions holds rows of one INT2 page (any row order) or DEAD.
* Attention is order-free over keys (RoPE is already in K), so this reordering is free.

Kernel: grid (kv_head, split, request) (``heads_fastest``; else (split, kv_head, request)).
A split covers a split length of positions of one
segment (each segment has its own, from :class:`DecodeConfig`), so it reads one pool; all
``Hq / Hkv`` query heads of the GQA group share the program and read each K/V row once.
DEAD positions, positions past the segment end and head-masked positions are predicated
off their loads (no bytes are read) and set to -inf before the softmax.

INT4 (issue 10): the per-token, per-32-channel-group scale ``s`` and zero ``z`` are folded
out of the inner loop, ``q.k = sum_g s_tg (q_g . c_tg) + z_tg sum(q_g)`` and
``sum_t p_t v_t = sum_t (p_t s_tg) c_t + sum_t p_t z_tg``, so the codes ``c`` only get an
exact int -> 16-bit conversion (magic number: ``nibble | 0x6400`` as fp16 is ``1024 + n``,
the 1024 removed *before* the dot) and the GQA group is not padded to 16 rows. By default
the (query head, channel group) pairs are stacked as the rows of one dot
(``int4_stacked``), and each row's interleaved scales and zeros are read as one tile
(``int4_scale_tile``); the per-group variant, a variant with fp16-dequantized values and the
previous kernel (``int4_legacy``) remain selectable. INT2: keys fold the page's
per-channel scale into the query (``(q * s) . code + q . zero``); by default (``int2_fold``)
values fold each token's group scale into ``p`` the same way and every code enters its dot
as an fp16 subnormal (no per-element dequantization); the previous path, values
dequantized in registers with packed f16x2 PTX, remains selectable. Its MMA operands are
fp16 whatever the query dtype, and its GQA group is unpadded too. Full precision: unchanged (16 padded rows, 64-token blocks).
Online softmax in base 2; a second kernel merges the splits by log-sum-exp.
Supported head_dim: 64 and 128 (other sizes: ``backend="torch"``).

Host side: a call's launches are planned once per distinct call (:class:`DecodePlan`, kept
under its shapes, strides, dtypes, alignment, pool layout, bounds, scalars and config) and
launched through :class:`~.direct_launch.DirectLaunch` (the compiled kernels' launchers,
without Triton's per-launch dispatch).
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .backend import Backend, resolve_backend, triton_interpreting
from .decode_attention_reference import decode_attention_ref
from .decode_int2_gluon import STAGES as INT2_GLUON_STAGES
from .decode_int2_gluon import (
    int2_split_gluon_args,
    int2_split_gluon_consts,
    int2_split_gluon_kernel,
)
from .decode_int4_gluon import STAGES as INT4_GLUON_STAGES
from .decode_int4_gluon import (
    int4_split_gluon_args,
    int4_split_gluon_consts,
    int4_split_gluon_kernel,
)
from .decode_mixed_gluon import (
    mixed_split_gluon_args,
    mixed_split_gluon_consts,
    mixed_split_gluon_kernel,
)
from .direct_launch import DirectLaunch
from .gluon_fragments import GLUON_AVAILABLE, MIN_CAPABILITY, head_mask_args, query_slot_args
from .packing import (
    INT4_CENTRE,
    dequant_int2_quads,
    dequant_int4_pairs,
    int2_code_quads,
    int2_code_quads_subnormal,
    int2_word_planes_f16,
    int4_code_bytes_i8,
    int4_code_pairs,
    int4_word_codes_f16,
    int4_word_codes_f16_subnormal,
)
from .pools import DEAD, INT2_PAGE, Int4RowMap, KVPools

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SegmentMaxLens:
    """Host-side upper bounds (positions) of each segment over the batch. They size the
    grid without a device sync; a zero bound skips that pool's code entirely. Held as
    Python ints (anything ``operator.index`` takes: numpy or 0-d integer tensors are read
    once here; the split plans are cached on them); a negative bound is a ValueError."""

    int2: int
    int4: int
    full: int

    def __post_init__(self) -> None:
        for name in ("int2", "int4", "full"):
            value = operator.index(getattr(self, name))
            if value < 0:
                raise ValueError(f"SegmentMaxLens.{name} must be >= 0, got {value}")
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs (``benchmarks/decode_attention.py --tune`` sweeps them on the GPU).

    block_n_full / block_n_int4: positions per inner iteration (INT2 is one 32-token page).
    num_warps, num_stages: per program (one launch: shared by every segment); None: see
    :meth:`warps` (1 with INT4 or folded INT2 segments, else 2) and :meth:`stages` (3 with
    INT4 segments, else 2), the H100 tuning winners (docs/benchmarks.md §3).
    programs_per_sm / _int4 / _int2: target programs per SM when choosing the split length
    of the full / INT4 / INT2 segments (more programs: more splits, shorter ones).
    min_split_len: shortest split (positions; 128 since session 16: where a request is short
    and the batch small, shorter splits put more of the GPU's program slots to work. H100,
    kernel time vs 256, geometric mean over B=1 N=4k / 8k / 16k, B=2 / 4 / 8 N=4k: INT4
    28.5 -> 25.2 µs, INT2 18.6 -> 16.1, mixed 27.7 -> 23.4, bf16 31.5 -> 30.5; B=1 N=4k INT2
    0.80x -> 1.07-1.16x SDPA; 64 was no better overall). min_block_hq: least query rows per program on the
    quantized paths (the GQA group is otherwise not padded to 16; the dot pads in hardware).
    int4_stacked: INT4 split as one dot over stacked (query head, channel group) rows; else
    one pair of dots per channel group (None: stacked when the stacked rows fit one 16-row
    MMA tile, i.e. GQA group x D/32 <= 16, where it compiles to the fewest instructions
    on sm_90; the per-group variant with fp16 values otherwise), with int4_v_fold choosing between
    scale-folded values (exact codes into the dot, ``p * s`` per group) and values
    dequantized to fp16 in registers. int4_legacy: the INT4 path before issue 10 (values
    dequantized to the query dtype, 16 padded rows, hand prefetch). int4_imma (implies
    stacked): the stacked key dot on the int8 tensor cores (IMMA): the codes become int8
    straight from the bytes (an and, a shift, an and per four bytes), each stacked query row
    is two int8 rows (``q ~= a / 256 * (256 hi + lo)``, ~1 / 65,000 of the row's largest
    value), one exact int32 dot gives both; values stay fp16. int4_lazy_rescale (stacked
    path): the online softmax moves its running max, and rescales the accumulators, only
    when a block's max exceeds it by more than 2**4 (FlashAttention-4's trick: the common
    iteration skips ``G * D`` multiplies). int4_v_subnormal (stacked path): value codes
    enter the fp16 value dot as the subnormals ``n * 2**-24`` (the nibble itself is the bit
    pattern: no magic number, no fma; exact, and the tensor cores multiply fp16 subnormals
    exactly), the 2**24 applied once at the store, and ``p * s`` formed in packed fp16.
    int4_v_dots8 (stacked path): one value
    dot per code tensor of the unpacked words (8 dots of N = D / 8 instead of 2 of D / 2
    after a join), so the words go from shared memory straight into the MMA operand layout
    and the codes are made there (no store / reload of the fp16 tile). int4_offsets32
    (stacked path): row offsets in int32 when the INT4 pool has < 2**31 bytes per tensor
    (fewer 64-bit address instructions). Defaults: every stacked-path knob on, int4_imma
    None = on wherever the stacked path runs (the H100 sweep of session 10: INT4 at B=8
    N=32k 202 µs vs 278 µs with them off, docs/benchmarks.md §3). prefetch: hand
    double-buffering of the INT2 (and legacy INT4) loads (the folded INT2 split only with
    ``int2_pipelined`` off). merge_block_s: the most splits per
    step of the merge kernel (each step takes the next power of two >= the splits, at least
    16, up to this and to 16,384 / the merge's channels per program): at B=1 N=32k (128
    splits) one step of 128 instead of four of 32 cut the merge from 7.1 to 3.0 µs on the
    H100, while a fixed 128 doubled it where 16 splits are merged (B=32 N=4k: 5.4 -> 9.2
    µs); H200, session 27: 256 instead of 128 merges B=1 N=32k's 171 splits (INT4) in one
    step, 2.9 -> 2.3 µs. int2_fold: the INT2 split with every scale folded out of the codes
    (key page scales into the query, value token scales into ``p``, codes as fp16
    subnormals: no per-element dequantization; its lazy rescale is ``int2_lazy_rescale``).
    max_registers: a cap on registers per thread (ptxas ``.maxnreg``): more programs per SM
    at the price of spills; None or 0: the compiler's choice (the H100 sweeps found every
    cap slower: the spills cost more than the occupancy buys), and 128 for the Gluon INT2
    split (``int2_gluon``), which needs no more.
    int2_v_words (folded INT2): value codes read as int32 words, each (byte, bit pair) its
    own dot operand with the code left in place (``(n << 2k) 2**-24``: a byte permute per
    byte and an ``and`` per code pair, no shift), made straight in the MMA operand layout.
    INT2 defaults (the H100 sweep of session 11): folded, value words, the page scales
    double-buffered by hand (``prefetch``), 1 warp: 154.5 µs at B=8 N=32k against 288.6 µs
    for the dequantizing split (2.33x vs 1.25x SDPA's kernel time). int4_live_from_scales
    (stacked INT4 path): a DEAD / out-of-range row's key zero loads as NaN and its score is
    masked from that, so the slot map is read only to form addresses: with ``num_stages``
    3 the compiler then pipelines it two blocks ahead (an asynchronous copy) instead of
    waiting for it in every iteration. A live row whose stored zero is NaN (a NaN key) is
    masked too, where it would otherwise make the output NaN. On by default with 3 stages
    for INT4 launches (H100, session 11: 195 vs 202 µs at B=8 N=32k, 150 vs 168 µs with 50%
    DEAD).
    max_split_len_folded: the longest split (positions, a multiple of 64) of the
    scale-folded segments (INT4 except ``int4_legacy`` / fp16-dequantized values /
    ``int4_v_centred``; folded INT2) for requests of up to ``folded_cap_len`` positions,
    whatever ``split_len`` says; longer requests get ``max_split_len_folded *
    sqrt(folded_cap_len / length)`` (a multiple of 64, at least 256); 0: no cap. Their
    output is the difference of two large one-signed sums (``sum p s c`` and ``sum p z``),
    and the tensor cores' fp32 accumulation truncates (rounds toward zero) the products it
    adds to a growing sum: a bias that grows with the split, and that the cancellation
    turns into a relative error. On the H100 (random K/V: near-uniform attention, so the
    output shrinks as 1/sqrt(length) and the bias stands out most) it rose from 2e-3 at
    1,024 positions per split to 1.8e-2 at 16,384 and 3.7e-2 at 65,536; at B=8 N=128k
    with fp16 output, 5.9e-3 uncapped, 1.1e-3 at 1,024 positions and 5.4e-4 at 512 (the
    dequantizing INT2 split and bf16 stay at their rounding floor at any length). Shorter
    splits mean more programs and partial outputs for the merge, not more reads (INT4 at
    B=8 N=128k: 726 µs at 1,024, 767 at 512). The Gluon INT4 split (``int4_gluon``) takes
    ``int4_gluon_cap_factor`` times this cap: each block's value dots start from zero and
    are added to the running sums in fp32, rounding to nearest, so no truncation bias
    builds up across blocks.
    heads_fastest: the split kernel's grid is (KV head, split, request) instead of (split,
    KV head, request), so the programs of one split's KV heads are neighbours in launch
    order and run together: the token rows they share (one slot-map entry; the 32-byte
    sectors of the INT4 scales, which hold four heads' rows) come from DRAM once and from
    L2 for the other heads. With the split fastest, a head's next program was
    ``splits`` launches away, far enough at 128 splits for the sectors to leave L2 between
    the heads (H100, B=8 N=128k INT4: 2.11 GB read for 1.14 GB of rows and scales).
    int4_v_centred (stacked folded path, with ``int4_v_subnormal`` off): the value codes
    enter the dot as ``c - 8`` (the magic-number conversion subtracts 1032 instead of
    1024: same instructions) and the zeros as ``z + 8 s``, so ``sum p s (c - 8)`` and
    ``sum p (z + 8 s)`` are each about the size of the output instead of two large sums
    that cancel: the INT4 splits then need no ``max_split_len_folded`` cap.
    int4_scale_tile (stacked path, interleaved INT4 scales: the pool's default layout, see
    :class:`~.pools.Int4Pool`; not with ``int4_v_centred``): each row's ``[ks | kz | vs |
    vz]`` is read as one [BN, 16] tile, a 32-byte copy per row that the pipeliner issues
    ahead asynchronously, and spread to the stacked rows by exact 0/1 dots; the key rows
    are stacked group-major, and liveness comes from a second read of the slot map. The
    16-bit key-scale gathers it replaces were synchronous loads issued at the end of the
    previous iteration. H100, session 13: the INT4 split kernel 3-10% faster (B=8 N=32k
    169 vs 178 µs, B=32 N=32k 664 vs 742 µs; 217 instead of 238 registers); the same
    interleaved layout read by the gathers was 4-11% slower than four separate tensors.
    int2_pipelined (folded INT2): no prefetch by hand; the loads of a page block (code rows,
    the rows' value scales as one [32, D / 32] tile, the page's key scales straight in the
    query rows' shape) are tiles of at least 4 bytes a lane, which Triton's pipeliner
    copies ahead asynchronously (3 stages: one block ahead, double-buffered in shared
    memory). The hand prefetch kept the codes synchronous (loaded at the top of their
    iteration, their latency exposed every block) and made the loop one the pipeliner
    skips. H100, session 14: INT2 split kernel at B=8 N=32k 157 -> 129 µs
    (2.02x -> 2.67x SDPA's kernel time), B=32 N=4k 1.93x -> 2.39x, B=1 N=32k 1.81x ->
    2.39x, B=8 N=128k 2.25x -> 2.83x; errors unchanged. int2_lazy_rescale: the lazy
    rescale (see ``int4_lazy_rescale``) in the folded INT2 split; None: see
    :meth:`int2_lazy` (eager on INT2-only launches, lazy where INT4 segments share the
    launch: H100, session 14, split kernel at B=8 N=32k: INT2 118-125 µs eager vs 127-128
    lazy, mixed 154-157 eager vs 148 lazy; B=8 N=128k: INT2 453 vs 466, mixed 604 vs
    554-561). The Gluon INT2 split (``int2_gluon``) moves its running max whenever a head's
    max grows (so p <= 1 and the running max's token is not rounded; within noise of lazy
    on the H200) unless this is True (then only by more than 2**4).
    wave_splits: the split lengths from :func:`plan_wave_splits`: the launch's programs fill
    whole waves of the GPU's resident program slots (SMs x ``resident_programs``), the
    folded caps and ``min_split_len`` kept; ``programs_per_sm*`` are then unused. Off: about
    ``programs_per_sm*`` programs per SM (the plan before session 15, which launched e.g.
    2,048 programs at B=32 N=4k where one H100 wave holds 1,056). resident_programs: one
    SM's programs at once; None: :func:`resident_programs` of the compiled variant (its
    registers and shared memory, read once per variant). program_overhead_len: a program's
    fixed cost in positions (the planner's tie-break toward fewer, longer splits; about 10
    µs per program on the H100 at B=8 N=32k, ~128 positions of the INT4 split). H100,
    session 15, split kernel + merge vs the old plan: B=32 N=4k INT4 98 -> 89 µs (1.79x ->
    1.99x SDPA), INT2 2.40x -> 2.60x; B=64 N=2k INT4 1.46x -> 1.92x; B=4 N=16k INT4 1.51x ->
    1.80x; B=8 N=32k and B=1 N=32k unchanged (their plans are the same).
    chunked_splits (stacked INT4 launches without INT2 segments): the wave plan may give an
    INT4 program several chunks of the folded cap, each written to its own partial row with
    a fresh softmax state (so no row sums more than the cap: the same error), one prologue
    and one pipeline for all of them; the cap then no longer forces more programs than one
    wave holds (B=8 N=32k: 1,024 programs of 2 x 1,024 positions, one wave, instead of 2,048
    programs). Compiled as its own variant, only for launches that chunk. H100, session 16,
    split kernel: B=8 N=128k 713 -> 671 us (-6%), B=32 N=32k 665 -> 644 (-3%), B=8 N=32k
    169 -> 166 (-1.5%), B=32 N=128k 2,853 -> 2,824 (-1%); with INT2 segments in the launch
    it was 0.5-2.5% slower, hence off there.
    pdl: launch the merge as a programmatic dependent launch (Hopper and newer,
    :func:`launch_chain`): the last split kernel lets it launch as soon as its last
    programs have started, and the merge waits in-kernel (``griddepcontrol.wait``) for the
    splits' stores, so the launch gap (about 3 µs in a CUDA graph) overlaps the splits'
    tail. True: on for CUDA devices of compute capability >= 9 (never under the
    interpreter). None: the same, but only in launches with fewer (request, query head)
    rows than SMs (the narrow merge of ``merge_block_d``), or with ``pdl_splits``. H200,
    session 24, kernel time without / with the dependent merge (two rounds each): B=1 gains
    (INT2 N=4k 11.4 -> 10.6 µs, INT4 N=32k 29.4 -> 28.7, mixed N=4k 20.9 -> 20.5), B=8
    N=32k even, and wider merges lose (B=16 N=8k INT4 70.4 -> 72.7, mixed 64.0 -> 66.1; B=32
    N=4k mixed 63.2 -> 67.3 in one run and 64.1 -> 64.3 in the next, three segments 78.5 ->
    85.0; not profiled; the harness's A/A spread is ±5%). pdl_splits (with pdl): chain the
    split launches too (where one call has two or three: the Gluon INT2 split, the Gluon
    INT4 split, this module's split), each chained one running its programs on the SMs the
    previous grid's tail leaves idle and waiting for that grid at its end. True: every
    launch after the first; "last": only the last one; None: "last" where the last is this
    module's split running a full (bf16) segment alone, shorter than the quantized
    segments, behind a Gluon split (a recent window), else False. H200, session 24: all
    chained, mixed INT2 + INT4 launches were 8-12% slower at B=8 N=32k and B=32 N=4k and
    slower at B=1 and B=2 too (B=1 N=4k 23.6 vs 20.4 µs; the INT4 split chained behind the
    INT2 one alone, 24.2 vs 20.0); a 512-position bf16 window chained behind the Gluon INT4
    split gained (three segments: B=1 N=4k 27.3 -> 20.8 µs, B=1 N=32k 38.0 -> 33.4, B=4
    N=16k 50.5 -> 43.8, B=32 N=4k 80.2 -> 75.1, B=8 N=32k 111.5 -> 111.0).
    merge_block_d: output channels per merge program (a power of two, 16 to head_dim; None:
    head_dim when there are at least as many (request, query head) rows as SMs, else 32,
    so a small batch's merge runs on more of the GPU).
    int2_gluon: run the INT2 segment's splits on the Gluon kernel of
    :mod:`.decode_int2_gluon` (swapped MMA operands, codes made in the operand layout,
    ``movmatrix``; same math and partial rows), the other segments' splits on this module's
    kernel in a second launch. None: on for CUDA devices of compute capability >= 9 where it
    applies (head_dim 128, GQA group <= 8, int32 slot maps, ``int2_fold``; never under the
    interpreter), in launches with INT4 or full segments too; True: also on sm_80+, and a
    ValueError where it cannot run. H200, session 18, kernel time (the splits and the
    merge) vs the Triton INT2 split: INT2 at B=8 N=32k 90 vs 144 µs, B=8 N=128k 295 vs 476,
    B=1 N=32k 23.7 vs 24.8; mixed (3/4 INT2, 1/4 INT4) at B=8 N=32k 114 vs 164, B=32 N=4k
    74 vs 84 (docs/benchmarks.md §3). Small mixed launches kept the Triton split until
    session 24 (below 2**19 INT2 positions x (request, KV head) pairs: with the INT4 splits
    on the Triton kernel, two partly filled waves cost more than the faster INT2 split
    saved, B=1 N=32k 38 vs 32 µs); with both Gluon splits and the dependent merge they win
    there too. H200, session 24, default then vs both Gluon splits (two rounds each):
    mixed B=1 N=32k 32.4 vs 28.9 µs, B=4 N=16k 51.3 vs 39.8, B=1 N=4k 20.7 vs 19.1, B=2
    N=4k 20.7 vs 21.2; with a bf16 recent window too (three segments, the Triton split
    running the window) B=1 N=32k 61.0 vs 38.0, B=4 N=16k 105.8 vs 51.6, B=2 N=4k 31.6 vs
    28.4; from B=8 N=32k the same launches either way.
    int4_gluon: the same for the INT4 segment's splits, on the Gluon kernel of
    :mod:`.decode_int4_gluon` (per channel group a key dot with swapped operands, the
    token's scales applied to its accumulator row in fp32; codes as fp16 subnormals made
    in the operand layout from ``ldmatrix`` / ``ldmatrix.trans``; token rows gathered by
    ``cp.async``, four lanes to a row). None: on for CUDA sm_90+ where it applies (head_dim
    128, GQA group <= 8, int32 slot maps, 16-byte aligned pool tensors, not
    ``int4_legacy``; the pool's interleaved scales, with or without a per-channel key
    scale: with four separate scale tensors it ran 1.5x slower than the Triton split, H200
    session 20, B=8 N=32k 245 vs 164 µs), in launches with full segments too, and beside an
    INT2 segment only if that runs on the Gluon INT2 split too (the Triton launch then
    takes the full segment's splits alone); True: also on sm_80+, separate scales and any
    launch, and a ValueError where it cannot run. In mixed launches: see ``int2_gluon``
    (H200, session 20, mixed launches at B=32 N=4k 66 instead of 74 µs with the Gluon
    INT4 split). H200, kernel time vs the Triton INT4
    split: session 19, B=8 N=32k 132 vs 160 µs (1.87x vs 1.55x SDPA), B=1 N=32k 29 vs 35,
    B=32 N=4k 70 vs 89, B=8 N=128k 518 vs 648; session 20 (longer splits, see
    ``int4_gluon_cap_factor``), B=8 N=32k 123 vs 174 µs (2.04x vs 1.45x SDPA)
    (docs/benchmarks.md §3).
    int4_gluon_cap_factor: the Gluon INT4 split's longest split, in units of the folded cap
    (``max_split_len_folded``; 0: uncapped). H200, session 20, fp16 output vs the
    reference: 5.8e-4 at B=8 N=32k (the wave plan's 1,408 positions per split, under the
    4 x 1,024 cap: kernel time 123 instead of 133 µs with the 1,024 cap, 2.04x instead of
    1.90x SDPA), 7.1e-4 at B=8 N=128k uncapped (5,504 positions; 5.0e-4 at 512, the same
    time within 1%).
    int4_gluon_stages: the Gluon INT4 split's cp.async stages (2 or 3: one or two 32-token
    blocks in flight while one is computed; default None, by the launch and the pool, below). Its
    shared memory, hence its programs per SM, follow (3: 17,408 bytes, 12 per SM; 2:
    12,288, 16 per SM, its 128 registers' limit); H200, session 22, split kernel, 2 vs 3, on
    slot-major rows scattered at random: B=8 N=32k 141.6 vs 113.7 µs, B=32 N=32k 593 vs 533,
    B=32 N=4k 74 vs 66 (the copies' latency is not hidden by one block).
    On the store's head-major rows (session 27, kernel time, 2 vs 3) two stages gain where
    the launch has many (request, KV head) pairs, INT4 B=8 N=32k -3.0%, B=32 N=4k -2.5%,
    B=32 N=32k -1.1%, and lose at B=1 N=32k (+5.9%). Session 28 (two rounds each): on
    head-major rows whose cells came off the free list one by one (``random/head``) two
    stages are even (-2.4% to +1.1%, not the slot-major rows' loss above); on the store's
    rows (``sorted-live/head``) B=8 N=32k -3.0%, B=32 N=4k -2.2%, B=16 N=8k -2.7%, B=8 N=8k
    -1.9%, B=32 N=32k -0.7%, B=4 N=16k even (32 pairs); session 36, since session 30's plan
    for fewer, longer programs, also where the launch is narrow (two rounds, kernel µs, 3 ->
    2 stages: B=1 N=32k 23.5 -> 22.7, B=2 N=32k 39.0 -> 37.2, B=4 N=16k 39.3 -> 38.2, B=1
    N=8k 13.6 -> 12.6, B=1 N=128k even). None (the default): 2 for the INT4-only launch over
    a head-major pool (the store's), else 3 (:meth:`int4_stages`): the mixed launch keeps 3
    (its INT4 programs lost 6-9% at N <= 16k with 2, session 27; session 36: +1% to +13%
    at B <= 16, B=8 N=32k -3%), and so do slot-major pools (session 36, default grid on
    scattered slot-major rows, 2 stages: B=8 N=32k 134.2 µs, 1.84x SDPA; 3: 115.7, 2.18x).
    int4_gluon_resident_cap: plan the Gluon INT4 split (not the mixed launch) for this many
    programs per SM instead of its residency (12 or 16), where that plan's programs fit one
    wave of them and its splits are at most ``int4_gluon_resident_cap_split`` positions:
    half the programs, each twice as long, half the partial rows to store and merge, where
    a program's fixed cost (prologue, pipeline fill, partial rows) weighs on its short
    split. Longer splits keep the residency's plan: there the bytes in flight per SM bound
    them, and with half the positions DEAD (half the bytes of each block) 8 programs a SM
    ran 7-12% slower (B=8 N=32k, B=16 N=8k, B=32 N=4k) while every position live they were
    1.5% slower to 6% faster. 0: off. H200, session 30, kernel time on the store's rows, 8
    a SM vs off, every position live (two rounds): B=1 N=32k 23.1 vs 24.4 µs, B=4 N=16k
    38.2 vs 41.5, B=8 N=4k 25.0 vs 27.2; half the positions DEAD (one round): B=1 N=32k
    22.5 vs 22.4, B=4 N=16k 34.8 vs 35.5, B=8 N=4k 22.4 vs 22.9. Against 8 a SM, 6 took
    4-22% longer, 10 from 3% less (B=1 N=32k) to 11% more (B=4 N=16k).
    int2_gluon_stages: the same for the Gluon INT2 split (default 2: 10,240 bytes; 3: 13,312;
    16 programs per SM either way, its registers' limit). H200, session 22, split kernel, 2
    vs 3 (two rounds): B=1 N=32k 15.1 vs 18.3 µs, B=32 N=32k 265 vs 274, B=8 N=128k 271 vs
    276, B=8 N=32k 73.8 vs 73.8, B=32 N=4k 42.5 vs 44.4.
    mixed_gluon_fused: where both the INT2 and the INT4 splits run on their Gluon kernels,
    run them as one launch (:mod:`.decode_mixed_gluon`: one grid, per (KV head, request) the
    INT2 programs, then the INT4 ones, the two kernels' code and partial rows; 12 programs
    per SM instead of the INT2 split's 16), its splits planned together for that grid.
    False: two launches, one after the other. H200, session 25, kernel time two launches vs
    one (two rounds each, 3/4 INT2 then INT4): B=1 N=4k 19.4 vs 11.3 µs (0.66x -> 1.14x
    SDPA), B=1 N=32k 28.7 vs 22.2 (1.61x -> 2.08x), B=2 N=4k 20.6 vs 12.8, B=4 N=16k 40.7 vs
    34.7, B=8 N=4k 29.3 vs 22.9, B=16 N=8k 62.9 vs 53.2, B=8 N=32k 100.5 vs 96.0, B=32 N=4k
    62.7 vs 61.1, B=8 N=128k 385 vs 331, B=32 N=32k 359 vs 316, B=32 N=128k 1,391 vs 1,242;
    with a 512-position bf16 window too (three segments) B=1 N=32k 32.7 vs 22.3, B=32 N=4k
    73.6 vs 65.8.
    mixed_int4_cost: in that one launch's plan, what an INT4 position costs in INT2
    positions (>= 1): the segments are planned in INT2 units and the INT4 split is that
    many times shorter (a multiple of 64), so its programs end with the INT2 ones (the
    grids' per-position kernel times are about 1.5x apart: B=8 N=32k INT4 112 vs INT2
    73 µs). H200, session 25, one mixed launch, kernel time at cost 1 / 1.25 / 1.5 / 2
    (two rounds each): B=32 N=4k 61.8 / 56.2 / 55.3 / 70.8 µs, B=8 N=4k 24.3 / 22.6 / 22.3 /
    24.2, B=8 N=128k 337 / 327 / 326 / 338, B=1 N=32k 22.4 / 22.2 / 22.0 / 23.0, B=8 N=32k
    100.5 / 99.8 / 101.4 / 105.0, B=1 N=4k 11.4 / 11.2 / 11.6 / 11.5 (the last two within
    the harness's spread).
    direct_launch: launch each kernel the plan has launched before with the same
    specialization through its compiled launcher, not Triton's per-launch dispatch
    (:class:`~.direct_launch.DirectLaunch`; the plan itself is remembered either way, see
    :class:`DecodePlan`). False: Triton's ``kernel[grid](...)`` on every launch.
    """

    block_n_full: int = 64
    block_n_int4: int = 32
    num_warps: int | None = None
    num_stages: int | None = None
    programs_per_sm: int = 16
    programs_per_sm_int4: int = 16
    programs_per_sm_int2: int = 16
    min_split_len: int = 128
    min_block_hq: int = 1
    int4_v_fold: bool = True
    int4_legacy: bool = False
    int4_stacked: bool | None = None
    int4_imma: bool | None = None
    int4_lazy_rescale: bool = True
    int4_v_subnormal: bool = True
    int4_v_dots8: bool = True
    int4_offsets32: bool = True
    merge_block_s: int = 256
    prefetch: bool = True
    int2_fold: bool = True
    int2_v_words: bool = True
    int4_live_from_scales: bool = True
    max_registers: int | None = None
    max_split_len_folded: int = 1024
    folded_cap_len: int = 32768
    heads_fastest: bool = True
    int4_v_centred: bool = False
    int4_v_scales_by_dot: bool = True
    int4_scale_tile: bool = True
    int2_pipelined: bool = True
    int2_lazy_rescale: bool | None = None
    wave_splits: bool = True
    resident_programs: int | None = None
    program_overhead_len: int = 128
    chunked_splits: bool = True
    pdl: bool | None = None
    pdl_splits: bool | Literal["last"] | None = None
    merge_block_d: int | None = None
    int2_gluon: bool | None = None
    int4_gluon: bool | None = None
    int4_gluon_cap_factor: int = 4
    int4_gluon_stages: int | None = None
    int4_gluon_resident_cap: int = 8
    int4_gluon_resident_cap_split: int = 512
    int2_gluon_stages: int = INT2_GLUON_STAGES
    mixed_gluon_fused: bool = True
    mixed_int4_cost: float = 1.5
    direct_launch: bool = True

    def __post_init__(self) -> None:
        bd = self.merge_block_d
        if bd is not None and (bd < 16 or bd & (bd - 1)):
            raise ValueError(f"merge_block_d must be a power of two >= 16, got {bd}")
        bs = self.merge_block_s
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"merge_block_s must be a power of two >= 16, got {bs}")
        if self.int4_gluon_cap_factor < 0:
            raise ValueError(
                f"int4_gluon_cap_factor must be >= 0, got {self.int4_gluon_cap_factor}"
            )
        if not self.mixed_int4_cost >= 1.0:
            raise ValueError(f"mixed_int4_cost must be >= 1, got {self.mixed_int4_cost}")
        if self.pdl_splits not in (None, False, True, "last"):
            raise ValueError(
                f"pdl_splits must be None, False, True or 'last', got {self.pdl_splits!r}"
            )
        for knob in ("int4_gluon_resident_cap", "int4_gluon_resident_cap_split"):
            if getattr(self, knob) < 0:
                raise ValueError(f"{knob} must be >= 0, got {getattr(self, knob)}")
        for knob, allowed in (("int4_gluon_stages", (None, 2, 3)), ("int2_gluon_stages", (2, 3))):
            if getattr(self, knob) not in allowed:
                raise ValueError(f"{knob} must be 2 or 3, got {getattr(self, knob)}")
        if self.int4_v_centred and self.int4_v_subnormal:
            raise ValueError(
                "int4_v_centred needs int4_v_subnormal=False (the centred codes are made "
                "by the magic-number conversion, not as subnormals)"
            )

    def folded_split_cap(self, length: int) -> int:
        """The longest scale-folded split for requests of ``length`` positions (0: none)."""
        cap = self.max_split_len_folded
        if not cap or length <= self.folded_cap_len:
            return cap
        return max(256, int(cap * math.sqrt(self.folded_cap_len / length)) // 64 * 64)

    def stages(self, has_int4: bool, has_int2: bool = False) -> int:
        """``num_stages`` of a launch (None: 3 with INT4 segments, where the live-from-scales
        INT4 split pipelines its slot map two blocks ahead, and with pipelined folded INT2
        segments; else 2)."""
        if self.num_stages is not None:
            return self.num_stages
        int4 = has_int4 and self.int4_live_from_scales
        int2 = has_int2 and self.int2_fold and self.int2_pipelined
        return 3 if int4 or int2 else 2

    def int4_stages(self, mixed: bool = False, adjacent_slots: bool = True) -> int:
        """cp.async stages of the Gluon INT4 split (``mixed``: the INT4 programs of the one
        mixed launch; ``adjacent_slots``: a KV head's consecutive slots are adjacent rows, as
        in the store's head-major pools, not ``Hkv`` rows apart as in slot-major ones);
        None: see ``int4_gluon_stages``."""
        if self.int4_gluon_stages is not None:
            return self.int4_gluon_stages
        return 2 if adjacent_slots and not mixed else INT4_GLUON_STAGES

    def int2_lazy(self, has_int4: bool) -> bool:
        """Whether a launch's folded INT2 split rescales lazily (None: only where the
        launch also has INT4 segments, the H100 winner each way)."""
        if self.int2_lazy_rescale is not None:
            return self.int2_lazy_rescale
        return has_int4

    def warps(self, has_int4: bool, has_int2: bool = False) -> int:
        """``num_warps`` of a launch (None: 1 with INT4 or folded INT2 segments, else 2)."""
        if self.num_warps is not None:
            return self.num_warps
        return 1 if has_int4 or (has_int2 and self.int2_fold) else 2


_DEFAULT_CONFIG = DecodeConfig()


@triton.jit
def _mma(a, b, IEEE_F32: tl.constexpr):
    # The CPU interpreter of Triton 3.9 mis-computes bf16 dots: use exact fp32 there.
    if IEEE_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mma_acc(a, b, acc, IEEE_F32: tl.constexpr):
    """acc + a @ b (fp32 accumulator)."""
    if IEEE_F32:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, acc=acc)


@triton.jit
def _q_int4_group(
    q_rows, gmask, c_ptr, h, g: tl.constexpr, D: tl.constexpr, HAS_KCS: tl.constexpr, CD
):
    """Query rows' even / odd channels of 32-channel group ``g`` ([BH, 16] each, in CD, the
    per-channel key scale folded in) and their float32 sum [BH]."""
    c = 32 * g + 2 * tl.arange(0, 16)
    m = gmask[:, None]
    qe = tl.load(q_rows + c[None, :], mask=m, other=0.0).to(tl.float32)
    qo = tl.load(q_rows + c[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    if HAS_KCS:
        qe = qe * tl.load(c_ptr + h * D + c)[None, :]
        qo = qo * tl.load(c_ptr + h * D + c + 1)[None, :]
    qe = qe.to(CD)
    qo = qo.to(CD)
    return qe, qo, tl.sum(qe.to(tl.float32) + qo.to(tl.float32), 1)


@triton.jit
def _int4_group_dots(kb, qe, qo, CD, IEEE_F32: tl.constexpr, USE_ASM: tl.constexpr):
    """[BH, BN] = q_g . codes of one group (kb: [BN, 16] code bytes), exact codes."""
    ce, co = int4_code_pairs(kb, CD, USE_ASM)
    return _mma_acc(qo, tl.trans(co), _mma(qe, tl.trans(ce), IEEE_F32), IEEE_F32)


@triton.jit
def _int4_group_pv(vw, p, vs, a0, a1, a2, a3, IEEE_F32: tl.constexpr, USE_ASM: tl.constexpr):
    """Accumulate (p * s_g) @ codes of one value group. vw: [BN, 4] int32 words (the
    group's 16 code bytes of each row); a0..a3: [BH, 8] accumulators of the group's
    channels ``8w + 4 (m % 2) + 2i + m // 2`` (tile m, column 2w + i)."""
    bn: tl.constexpr = vw.shape[0]
    l0, l1, l2, l3, h0, h1, h2, h3 = int4_word_codes_f16(vw, USE_ASM, False)
    pg = (p * vs[None, :]).to(tl.float16)
    a0 = _mma_acc(pg, tl.reshape(tl.join(l0, l1), [bn, 8]), a0, IEEE_F32)
    a1 = _mma_acc(pg, tl.reshape(tl.join(l2, l3), [bn, 8]), a1, IEEE_F32)
    a2 = _mma_acc(pg, tl.reshape(tl.join(h0, h1), [bn, 8]), a2, IEEE_F32)
    a3 = _mma_acc(pg, tl.reshape(tl.join(h2, h3), [bn, 8]), a3, IEEE_F32)
    return a0, a1, a2, a3


@triton.jit
def _store_int4_group(
    po_ptr,
    row_q,
    g: tl.constexpr,
    a0,
    a1,
    a2,
    a3,
    zb,
    inv,
    gmask,
    D: tl.constexpr,
    NG: tl.constexpr,
):
    """Partial output of channel group g: (codes part + zero part) / l (tiles of
    :func:`_int4_group_pv`)."""
    zg = tl.sum(tl.where(tl.arange(0, NG)[None, :] == g, zb, 0.0), 1)[:, None]
    r = tl.arange(0, 8)
    base = 32 * g + 8 * (r // 2) + 2 * (r % 2)
    m = gmask[:, None]
    rows = po_ptr + row_q[:, None] * D
    tl.store(rows + base[None, :], (a0 + zg) * inv[:, None], mask=m)
    tl.store(rows + base[None, :] + 4, (a1 + zg) * inv[:, None], mask=m)
    tl.store(rows + base[None, :] + 1, (a2 + zg) * inv[:, None], mask=m)
    tl.store(rows + base[None, :] + 5, (a3 + zg) * inv[:, None], mask=m)


@triton.jit
def _online_softmax(qk, m_i, l_i):
    """qk: [BH, BN] log2-scaled scores (-inf = masked). Returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _live_positions(slot_row_ptr, hm_row_ptr, offs_n, end, dead_id, HAS_HEAD_MASK: tl.constexpr):
    inb = offs_n < end
    slot = tl.load(slot_row_ptr + offs_n, mask=inb, other=dead_id).to(tl.int64)
    live = inb & (slot != dead_id)
    if HAS_HEAD_MASK:
        live = live & (tl.load(hm_row_ptr + offs_n, mask=inb, other=0) != 0)
    return slot, live


@triton.jit
def _rows_of(slot, live, base, Hkv, h):
    """Row index (slot * Hkv + head) of each live position in a pool starting at ``base``."""
    return tl.where(live, slot - base, 0) * Hkv + h


@triton.jit
def _bcast_groups(x, R: tl.constexpr, NG: tl.constexpr, W: tl.constexpr):
    """[R, NG] -> [R, NG * W], each group value repeated W times."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (R, NG, W)), (R, NG * W))


@triton.jit
def _int4_block(
    slot,
    live,
    int4_base,
    slot_rows,
    head_row,
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    D: tl.constexpr,
    NG: tl.constexpr,
    SS: tl.constexpr,
):
    """Raw loads of one block of INT4 rows (DEAD / out-of-range rows are not read; row
    ``slot * slot_rows + head_row``, :meth:`~.pools.Int4Pool.row_map`; SS: the scale
    tensors' row stride)."""
    row = tl.where(live, slot - int4_base, 0) * slot_rows + head_row
    lm = live[:, None]
    co = row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    so = row[:, None] * SS + tl.arange(0, NG)[None, :]
    kb = tl.load(k_ptr + co, mask=lm, other=0)
    vb = tl.load(v_ptr + co, mask=lm, other=0)
    ks = tl.load(ks_ptr + so, mask=lm, other=0.0)
    kz = tl.load(kz_ptr + so, mask=lm, other=0.0)
    vs = tl.load(vs_ptr + so, mask=lm, other=0.0)
    vz = tl.load(vz_ptr + so, mask=lm, other=0.0)
    return kb, vb, ks, kz, vs, vz


@triton.jit
def _int2_page_rows(slot, live, int2_base, Hkv, h):
    """A 32-position block's INT2 page row ``page * Hkv + head`` (from its live slots) and
    each position's row in the page's rows (0 where not live)."""
    j = tl.where(live, slot - int2_base, -1)
    ph = (tl.maximum(tl.max(j, 0), 0) // 32) * Hkv + h
    return ph, ph * 32 + tl.where(live, j % 32, 0)


@triton.jit
def _int2_key_planes(ks_ptr, kz_ptr, kc, Q: tl.constexpr):
    """The page's key scales and zeros of channel planes 0..3 at offsets ``kc + kQ``."""
    ks0 = tl.load(ks_ptr + kc)
    ks1 = tl.load(ks_ptr + kc + Q)
    ks2 = tl.load(ks_ptr + kc + 2 * Q)
    ks3 = tl.load(ks_ptr + kc + 3 * Q)
    kz0 = tl.load(kz_ptr + kc)
    kz1 = tl.load(kz_ptr + kc + Q)
    kz2 = tl.load(kz_ptr + kc + 2 * Q)
    kz3 = tl.load(kz_ptr + kc + 3 * Q)
    return ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3


@triton.jit
def _int2_page_loads(
    slot,
    live,
    int2_base,
    Hkv,
    h,
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
):
    """Raw loads of one 32-position block (one INT2 page): code bytes, per-row value scales
    of the group of each planar channel block, and the page's key scales / zeros per block
    (ks_i, kz_i: [BLOCK_H, D // 4], rows identical, in the query's layout)."""
    NG: tl.constexpr = D // 32
    Q: tl.constexpr = D // 4
    ph, row = _int2_page_rows(slot, live, int2_base, Hkv, h)
    co = row[:, None] * Q + tl.arange(0, Q)[None, :]
    kb = tl.load(k_ptr + co, mask=live[:, None], other=0)
    vb = tl.load(v_ptr + co, mask=live[:, None], other=0)
    so = row * NG
    vs0 = tl.load(vs_ptr + so + (0 * Q) // 32, mask=live, other=0.0)
    vz0 = tl.load(vz_ptr + so + (0 * Q) // 32, mask=live, other=0.0)
    vs1 = tl.load(vs_ptr + so + (1 * Q) // 32, mask=live, other=0.0)
    vz1 = tl.load(vz_ptr + so + (1 * Q) // 32, mask=live, other=0.0)
    vs2 = tl.load(vs_ptr + so + (2 * Q) // 32, mask=live, other=0.0)
    vz2 = tl.load(vz_ptr + so + (2 * Q) // 32, mask=live, other=0.0)
    vs3 = tl.load(vs_ptr + so + (3 * Q) // 32, mask=live, other=0.0)
    vz3 = tl.load(vz_ptr + so + (3 * Q) // 32, mask=live, other=0.0)
    kc = ph * D + tl.arange(0, Q)[None, :]  # [1, Q]: broadcast over heads at use
    ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3 = _int2_key_planes(ks_ptr, kz_ptr, kc, Q)
    return kb, vb, vs0, vz0, vs1, vz1, vs2, vz2, vs3, vz3, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3


@triton.jit
def _bcast_rows(x, like):
    """[R] -> like.shape [R, C] in like's dtype, each row constant."""
    return tl.broadcast_to(x.to(like.dtype)[:, None], like.shape)


@triton.jit
def _store_lse(plse_ptr, row_o, m_i, l_i, hmask):
    """Log2-sum-exp of a split's rows (-inf where nothing was live)."""
    has = l_i > 0.0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(plse_ptr + row_o, lse, mask=hmask)


@triton.jit
def _store_partial(po_ptr, row_o, cols, acc, l_i, hmask, D: tl.constexpr):
    """Normalised partial output acc / l_i [BH, C] into columns ``cols`` of the split row."""
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(po_ptr + row_o[:, None] * D + cols[None, :], out, mask=hmask[:, None])


@triton.jit
def _q_int8_hi_lo(qe, qo, lo_row):
    """Stacked query rows as int8 for the integer tensor cores. qe, qo: [2R, C] float32
    (even / odd channels; rows ``r`` and ``R + r`` hold the same query row), lo_row [2R]:
    True on the second copy. Returns (even, odd) [2R, C] int8 and the row scale [2R]:
    first copies ``hi = round(q / a)``, second copies ``lo = round((q / a - hi) * 256)``,
    ``a = max|q_r| / 127``, so ``q ~= a / 256 * (256 hi + lo)`` to ~1 / 65,000 of the row's
    largest value (one exact int32 dot gives both halves); scale = ``a / 256``."""
    amax = tl.maximum(tl.max(tl.abs(qe), 1), tl.max(tl.abs(qo), 1))
    a = tl.where(amax > 0.0, amax / 127.0, 1.0)
    xe = qe / a[:, None]
    xo = qo / a[:, None]
    he = tl.floor(xe + 0.5)
    ho = tl.floor(xo + 0.5)
    le = tl.minimum(tl.maximum(tl.floor((xe - he) * 256.0 + 0.5), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(tl.floor((xo - ho) * 256.0 + 0.5), -127.0), 127.0)
    sel = lo_row[:, None]
    return tl.where(sel, le, he).to(tl.int8), tl.where(sel, lo, ho).to(tl.int8), a / 256.0


@triton.jit
def _store_own(ptrs, acc, own, z, inv, v_one, gmask, BLOCK_HQ: tl.constexpr, NG: tl.constexpr):
    """Store (each head's own-group rows of acc [BLOCK_HQ * NG, W]) * v_one + z, over l."""
    w: tl.constexpr = acc.shape[1]
    o = tl.sum(tl.reshape(tl.where(own, acc, 0.0), [BLOCK_HQ, NG, w]), 1)
    tl.store(ptrs, (o * v_one + z) * inv[:, None], mask=gmask[:, None])


@triton.jit
def _spread_cols(x, grp):
    """[R, 16] -> [R, C]: column c of the result is column ``grp[c]`` ([C]) of x."""
    c16 = tl.arange(0, 16)
    pick = c16[None, None, :] == grp[None, :, None]
    return tl.sum(tl.where(pick, x[:, None, :], 0.0), 2)


@triton.jit
def _store_int4_stacked(
    po_ptr,
    plse_ptr,
    row_q,
    gmask,
    m_i,
    l_i,
    zb,
    accs,
    D: tl.constexpr,
    V_SUBNORMAL: tl.constexpr,
    V_DOTS8: tl.constexpr,
    SCALE_TILE: tl.constexpr,
):
    """Partial output rows ``row_q`` ([BLOCK_HQ] int64, masked by ``gmask``) of
    :func:`_int4_split_stacked`: each head's own-group rows of the stacked accumulators
    ``accs`` (V_DOTS8: the eight (byte, nibble) accumulators a0..a7, else (acc_e, acc_o)),
    plus the zero part, over l; and the rows' log2-sum-exp."""
    BLOCK_HQ: tl.constexpr = m_i.shape[0]
    NG: tl.constexpr = D // 32
    R: tl.constexpr = BLOCK_HQ * NG
    H2: tl.constexpr = D // 2
    W: tl.constexpr = D // 8
    rg = tl.arange(0, R) % NG
    j = tl.arange(0, H2)
    jw = tl.arange(0, W)
    inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    v_one = 16777216.0 if V_SUBNORMAL else 1.0
    if V_DOTS8:
        # accumulator k holds channel 8w + 2 (k % 4) + k // 4 in column w (group w // 4)
        if SCALE_TILE:
            z4 = _spread_cols(zb, 3 * NG + jw // 4)  # the tile's value-zero columns
        else:
            z4 = _bcast_groups(zb, BLOCK_HQ, NG, 4)
        a0, a1, a2, a3, a4, a5, a6, a7 = accs
        own8 = rg[:, None] == (jw // 4)[None, :]
        prow = po_ptr + row_q[:, None] * D + 8 * jw[None, :]
        _store_own(prow + 0, a0, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 2, a1, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 4, a2, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 6, a3, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 1, a4, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 3, a5, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 5, a6, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
        _store_own(prow + 7, a7, own8, z4, inv, v_one, gmask, BLOCK_HQ, NG)
    else:
        acc_e, acc_o = accs
        own = rg[:, None] == (j // 16)[None, :]
        oe = tl.sum(tl.reshape(tl.where(own, acc_e, 0.0), [BLOCK_HQ, NG, H2]), 1) * v_one
        oo = tl.sum(tl.reshape(tl.where(own, acc_o, 0.0), [BLOCK_HQ, NG, H2]), 1) * v_one
        if SCALE_TILE:
            z16 = _spread_cols(zb, 3 * NG + j // 16)
        else:
            z16 = _bcast_groups(zb, BLOCK_HQ, NG, 16)
        out = tl.interleave(oe + z16, oo + z16) * inv[:, None]
        tl.store(po_ptr + row_q[:, None] * D + tl.arange(0, D)[None, :], out, mask=gmask[:, None])
    _store_lse(plse_ptr, row_q, m_i, l_i, gmask)


@triton.jit
def _int4_split_stacked(
    q_ptr,
    stride_qb,
    stride_qh,
    slot_row,
    hm_row,
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    c_ptr,
    po_ptr,
    plse_ptr,
    qk_scale,
    dead_id,
    int4_base,
    slot_rows,
    head_rows,
    Hkv,
    b,
    h,
    s,
    start,
    end,
    S_total,
    chunk,
    n_chunks,
    G: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    D: tl.constexpr,
    BN: tl.constexpr,
    HAS_HEAD_MASK: tl.constexpr,
    HAS_KCS: tl.constexpr,
    IEEE_F32: tl.constexpr,
    USE_ASM: tl.constexpr,
    KEY_IMMA: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    V_SUBNORMAL: tl.constexpr,
    V_DOTS8: tl.constexpr,
    OFFS32: tl.constexpr,
    LIVE_FROM_SCALES: tl.constexpr,
    V_CENTRED: tl.constexpr,
    V_SCALES_BY_DOT: tl.constexpr,
    SS: tl.constexpr,
    SCALE_TILE: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """One INT4 split with (query head, channel group) pairs stacked as the rows of one dot.

    Row ``r = head * NG + group`` of the stacked query holds that head's channels of that
    32-channel group (zeros elsewhere), so one dot against a row's exact codes gives every
    group's partial score and the per-token group scales apply afterwards
    (``q.k = sum_g s_tg (q_g . c_tg) + z_tg sum(q_g)``). For values, the stacked rows
    carry ``p_t s_tg`` and each output channel takes its own group's row at the end
    (``sum_t (p_t s_tg) c_tc``), plus ``sum_t p_t z_tg`` from one small dot. V_CENTRED: the
    value codes enter as ``c - 8`` and the zeros as ``z + 8 s``, so neither sum grows
    one-signed over the split (see ``DecodeConfig.int4_v_centred``).

    CHUNKS: the range [start, end) spans up to ``n_chunks`` chunks of ``chunk`` positions
    (``DecodeConfig.chunked_splits``); each chunk's partial goes to its own row (``s``, ``s +
    1``, ...) and the state restarts, so a row sums no more than ``chunk`` positions (the
    folded sums' precision cap) while the program keeps one prologue and one pipeline."""
    NG: tl.constexpr = D // 32
    R: tl.constexpr = BLOCK_HQ * NG
    H2: tl.constexpr = D // 2
    DEAD_KZ: tl.constexpr = float("nan") if LIVE_FROM_SCALES else 0.0
    dt = q_ptr.dtype.element_ty
    rr = tl.arange(0, R)
    rh = rr // NG  # the value side's stacked rows: head-major
    rg = rr % NG
    if SCALE_TILE:
        # the key side's stacked rows group-major (r = group * BLOCK_HQ + head): in the
        # integer dot's layout the group sum then stays within a lane and its neighbour
        # half a warp away, and the scores need no layout change
        krh = rr % BLOCK_HQ
        krg = rr // BLOCK_HQ
    else:
        krh = rh
        krg = rg
    j = tl.arange(0, H2)  # byte j: channels 2j (low nibble) and 2j + 1, group j // 16
    in_g = (krh < G)[:, None] & ((j // 16)[None, :] == krg[:, None])
    qrow = q_ptr + b * stride_qb + (h * G + krh)[:, None] * stride_qh
    qe = tl.load(qrow + 2 * j[None, :], mask=in_g, other=0.0).to(tl.float32)
    qo = tl.load(qrow + 2 * j[None, :] + 1, mask=in_g, other=0.0).to(tl.float32)
    if HAS_KCS:
        qe = qe * tl.load(c_ptr + h * D + 2 * j)[None, :]
        qo = qo * tl.load(c_ptr + h * D + 2 * j + 1)[None, :]
    amax = tl.maximum(tl.max(tl.abs(qe), 1), tl.max(tl.abs(qo), 1))  # [R], as _q_int8_hi_lo
    qe = qe.to(dt)
    qo = qo.to(dt)
    qs = tl.sum(qe.to(tl.float32) + qo.to(tl.float32), 1) * qk_scale  # [R]
    if KEY_IMMA:  # the stacked rows twice (hi and lo halves) as int8
        # loaded channel-contiguous and split into even / odd channels in registers, so the
        # int8 operand's shared-memory copy is K-major (ldmatrix; Triton 3.6 otherwise reads
        # it byte by byte every iteration)
        r2 = tl.arange(0, 2 * R) % R
        dd = tl.arange(0, D)
        if SCALE_TILE:
            kh2 = r2 % BLOCK_HQ
            kg2 = r2 // BLOCK_HQ
        else:
            kh2 = r2 // NG
            kg2 = r2 % NG
        in2 = (kh2 < G)[:, None] & ((dd // 32)[None, :] == kg2[:, None])
        qrow2 = q_ptr + b * stride_qb + (h * G + kh2)[:, None] * stride_qh
        q2 = tl.load(qrow2 + dd[None, :], mask=in2, other=0.0).to(tl.float32)
        if HAS_KCS:
            q2 = q2 * tl.load(c_ptr + h * D + dd)[None, :]
        q2e, q2o = tl.split(tl.reshape(q2, [2 * R, H2, 2]))
        qe8, qo8, _ = _q_int8_hi_lo(q2e, q2o, tl.arange(0, 2 * R) >= R)
        q8s = tl.where(amax > 0.0, amax / 127.0, 1.0) / 256.0 * qk_scale  # [R]
    m_i = tl.full([BLOCK_HQ], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_HQ], tl.float32)
    W: tl.constexpr = D // 8
    if V_DOTS8:  # one accumulator per (byte k, nibble) of the value words: [R, W] each
        acc_e = tl.zeros([R, 2], tl.float32)  # unused
        acc_o = tl.zeros([R, 2], tl.float32)
        a0 = tl.zeros([R, W], tl.float32)
        a1 = tl.zeros([R, W], tl.float32)
        a2 = tl.zeros([R, W], tl.float32)
        a3 = tl.zeros([R, W], tl.float32)
        a4 = tl.zeros([R, W], tl.float32)
        a5 = tl.zeros([R, W], tl.float32)
        a6 = tl.zeros([R, W], tl.float32)
        a7 = tl.zeros([R, W], tl.float32)
    else:
        acc_e = tl.zeros([R, H2], tl.float32)
        acc_o = tl.zeros([R, H2], tl.float32)
    zb = tl.zeros([BLOCK_HQ, NG], tl.float32)
    arn = tl.arange(0, BN)
    cng = tl.arange(0, NG)
    jw = tl.arange(0, W)
    c16 = tl.arange(0, 16)
    in_ng = (c16 < NG)[None, :]
    if V_SCALES_BY_DOT:
        e_rows = (c16[None, :] == rg[:, None]).to(tl.float16)  # [R, 16]
    if SCALE_TILE:  # 0/1 matrices picking each stacked row's scale column of the row tile
        zb = tl.zeros([BLOCK_HQ, 16], tl.float32)  # sum p x over the tile's 16 columns
        in_4ng = (c16 < 4 * NG)[None, :]
        e_ks = (c16[None, :] == krg[:, None]).to(tl.float16)
        e_kz = (c16[None, :] == (NG + krg)[:, None]).to(tl.float16)
        e_vs = (c16[None, :] == (2 * NG + rg)[:, None]).to(tl.float16)
    gmask0 = tl.arange(0, BLOCK_HQ) < G
    row_q0 = (b * (Hkv * G) + h * G + tl.arange(0, BLOCK_HQ)).to(tl.int64) * S_total
    if CHUNKS:
        s_first = s
        chunk_end = start + chunk  # the current chunk's end
    for start_n in range(start, end, BN):
        slot, live = _live_positions(slot_row, hm_row, start_n + arn, end, dead_id, HAS_HEAD_MASK)
        row = tl.where(live, slot - int4_base, 0) * slot_rows + h * head_rows
        if OFFS32:  # the pool's byte offsets fit int32 (checked on the host)
            row = row.to(tl.int32)
        lm = live[:, None]
        co = row[:, None] * H2 + j[None, :]
        kb = tl.load(k_ptr + co, mask=lm, other=0)
        vw = tl.load(
            v_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * (D // 8) + jw[None, :],
            mask=lm,
            other=0,
        )
        so = row * SS  # the row's first scale (SS: the scale tensors' row stride)
        if SCALE_TILE:
            # the row's [ks | kz | vs | vz] (4 NG fp16 side by side: one 32-byte sector for
            # D=128) as one [BN, 16] tile, one copy per row, which the pipeliner issues
            # ahead asynchronously; each part spread to its stacked rows by an exact 0/1 dot
            st = tl.load(ks_ptr + so[:, None] + c16[None, :], mask=lm & in_4ng, other=0.0)
            stt = tl.trans(st)
            ks = _mma(e_ks, stt, IEEE_F32)
            kz = _mma(e_kz, stt, IEEE_F32)
            vs = _mma(e_vs, stt, IEEE_F32).to(tl.float16)
            vz = st  # its value-zero columns 3 NG.. give sum p z (the rest is unused)
        else:
            ssel = so[None, :] + rg[:, None]  # [R, BN]: token's scale of the row's group
            lsel = live[None, :] & (rr >= 0)[:, None]
            ks = tl.load(ks_ptr + ssel, mask=lsel, other=0.0).to(tl.float32)
            kz = tl.load(kz_ptr + ssel, mask=lsel, other=DEAD_KZ).to(tl.float32)
            if V_SCALES_BY_DOT:
                # the value scales as a [BN, 16] tile (columns >= NG masked), spread to the
                # stacked rows by a dot with the 0/1 matrix E (row r takes group r % NG;
                # exact): a dot operand, so the pipeliner copies it ahead asynchronously
                # instead of a synchronous gather in every iteration
                vs16 = tl.load(vs_ptr + so[:, None] + c16[None, :], mask=lm & in_ng, other=0.0)
                vs = _mma(e_rows, tl.trans(vs16), IEEE_F32).to(tl.float16)
            else:
                vs = tl.load(vs_ptr + ssel, mask=lsel, other=0.0)
            vz = tl.load(vz_ptr + so[:, None] + cng[None, :], mask=lm, other=0.0)
        if V_CENTRED:  # z + 8 s: the zero of the centred codes (same sectors as vs: L1)
            vsg = tl.load(vs_ptr + so[:, None] + cng[None, :], mask=lm, other=0.0)
            vz = (vz.to(tl.float32) + INT4_CENTRE * vsg.to(tl.float32)).to(vz.dtype)
        if KEY_IMMA:
            # int8 codes straight from the bytes, one exact int32 dot for hi and lo rows
            ke8, ko8 = int4_code_bytes_i8(kb, USE_ASM)
            si = tl.dot(qe8, tl.trans(ke8), out_dtype=tl.int32)  # [2R, BN]
            si = tl.dot(qo8, tl.trans(ko8), si, out_dtype=tl.int32)
            s_hi, s_lo = tl.split(tl.permute(tl.reshape(si, [2, R, BN]), (1, 2, 0)))
            sst = (s_hi * 256 + s_lo).to(tl.float32) * (ks * q8s[:, None]) + qs[:, None] * kz
        else:
            ce, cod = int4_code_pairs(kb, dt, USE_ASM)
            sst = _mma_acc(qo, tl.trans(cod), _mma(qe, tl.trans(ce), IEEE_F32), IEEE_F32)
            sst = sst * (ks * qk_scale) + qs[:, None] * kz
        if SCALE_TILE:
            qk = tl.sum(tl.reshape(sst, [NG, BLOCK_HQ, BN]), 0)
            # liveness from a second read of the block's slot-map entries (a load of its
            # own, copied ahead like the rows; the first read forms the addresses, one
            # block further ahead): a DEAD row's scales read as zeros, not NaN
            offs2 = start_n + arn
            inb2 = offs2 < end
            slot2 = tl.load(
                slot_row + offs2, mask=inb2, other=dead_id, eviction_policy="evict_last"
            )
            live2 = inb2 & (slot2 != dead_id)
            if HAS_HEAD_MASK:
                hm2 = tl.load(hm_row + offs2, mask=inb2, other=0, eviction_policy="evict_last")
                live2 = live2 & (hm2 != 0)
            qk = tl.where(live2[None, :], qk, float("-inf"))
        else:
            qk = tl.sum(tl.reshape(sst, [BLOCK_HQ, NG, BN]), 1)
            if LIVE_FROM_SCALES:  # a DEAD row's zero loads as NaN: so does its score
                qk = tl.where(qk == qk, qk, float("-inf"))
            else:
                qk = tl.where(live[None, :], qk, float("-inf"))
        if LAZY_RESCALE:
            # the running max moves (and the accumulators are rescaled) only when some row's
            # block max exceeds it by more than 2**4: p <= 16 otherwise (exact: l, acc and zb
            # share the stale max, and the split's output divides it out; p * s in fp16
            # stays finite unless a value group spans > 60,000)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            if tl.max(m_new - m_i, 0) > 4.0:
                alpha = tl.exp2(m_i - m_new)
                alr = tl.reshape(tl.broadcast_to(alpha[:, None], [BLOCK_HQ, NG]), [R])[:, None]
                l_i = l_i * alpha
                zb = zb * alpha[:, None]
                if V_DOTS8:
                    a0, a1, a2, a3 = a0 * alr, a1 * alr, a2 * alr, a3 * alr
                    a4, a5, a6, a7 = a4 * alr, a5 * alr, a6 * alr, a7 * alr
                else:
                    acc_e = acc_e * alr
                    acc_o = acc_o * alr
                m_i = m_new
            p = tl.exp2(qk - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
            alr = tl.reshape(tl.broadcast_to(alpha[:, None], [BLOCK_HQ, NG]), [R])[:, None]
            zb = zb * alpha[:, None]
            if V_DOTS8:
                a0, a1, a2, a3 = a0 * alr, a1 * alr, a2 * alr, a3 * alr
                a4, a5, a6, a7 = a4 * alr, a5 * alr, a6 * alr, a7 * alr
            else:
                acc_e = acc_e * alr
                acc_o = acc_o * alr
        zb = _mma_acc(p.to(tl.float16), vz, zb, IEEE_F32)
        if V_SUBNORMAL or V_CENTRED:  # p * s in packed fp16 (rounded to fp16 for the dot anyway)
            p16 = p.to(tl.float16)
            pst = tl.reshape(tl.broadcast_to(p16[:, None, :], [BLOCK_HQ, NG, BN]), [R, BN]) * vs
        else:
            pst = tl.reshape(tl.broadcast_to(p[:, None, :], [BLOCK_HQ, NG, BN]), [R, BN]) * vs.to(
                tl.float32
            )
        if V_SUBNORMAL:  # codes n as fp16 n * 2**-24: the 2**24 comes back at the store
            l0, l1, l2, l3, h0, h1, h2, h3 = int4_word_codes_f16_subnormal(vw, USE_ASM)
        else:
            l0, l1, l2, l3, h0, h1, h2, h3 = int4_word_codes_f16(vw, USE_ASM, V_CENTRED)
        pst = pst.to(tl.float16)
        if V_DOTS8:  # no join: each code tensor is a dot operand as loaded
            a0 = _mma_acc(pst, l0, a0, IEEE_F32)
            a1 = _mma_acc(pst, l1, a1, IEEE_F32)
            a2 = _mma_acc(pst, l2, a2, IEEE_F32)
            a3 = _mma_acc(pst, l3, a3, IEEE_F32)
            a4 = _mma_acc(pst, h0, a4, IEEE_F32)
            a5 = _mma_acc(pst, h1, a5, IEEE_F32)
            a6 = _mma_acc(pst, h2, a6, IEEE_F32)
            a7 = _mma_acc(pst, h3, a7, IEEE_F32)
        else:
            ve = tl.reshape(tl.join(tl.join(l0, l2), tl.join(l1, l3)), [BN, H2])
            vo = tl.reshape(tl.join(tl.join(h0, h2), tl.join(h1, h3)), [BN, H2])
            acc_e = _mma_acc(pst, ve, acc_e, IEEE_F32)
            acc_o = _mma_acc(pst, vo, acc_o, IEEE_F32)
        # a chunk ends inside the range: its partial row, then a fresh state (constexpr guard
        # outside, runtime branch inside)
        if CHUNKS:  # noqa: SIM102
            if (start_n + BN == chunk_end) & (chunk_end < end):
                if V_DOTS8:
                    accs = (a0, a1, a2, a3, a4, a5, a6, a7)
                else:
                    accs = (acc_e, acc_o)
                _store_int4_stacked(po_ptr, plse_ptr, row_q0 + s, gmask0, m_i, l_i, zb, accs, D, V_SUBNORMAL, V_DOTS8, SCALE_TILE)  # fmt: skip
                s += 1
                chunk_end += chunk
                m_i = tl.full([BLOCK_HQ], -1.0e30, tl.float32)
                l_i = tl.zeros([BLOCK_HQ], tl.float32)
                zb = tl.zeros_like(zb)
                if V_DOTS8:
                    z8 = tl.zeros_like(a0)
                    a0, a1, a2, a3, a4, a5, a6, a7 = z8, z8, z8, z8, z8, z8, z8, z8
                else:
                    acc_e, acc_o = tl.zeros_like(acc_e), tl.zeros_like(acc_o)
    if V_DOTS8:
        accs = (a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        accs = (acc_e, acc_o)
    _store_int4_stacked(po_ptr, plse_ptr, row_q0 + s, gmask0, m_i, l_i, zb, accs, D, V_SUBNORMAL, V_DOTS8, SCALE_TILE)  # fmt: skip
    if CHUNKS:  # the chunks this program did not reach (its range ended early): empty rows
        for r in range(s + 1, s_first + n_chunks):
            _store_lse(plse_ptr, row_q0 + r, m_i, tl.zeros_like(l_i), gmask0)


@triton.jit
def _int2_fold_scales(
    slot, live, int2_base, Hkv, h, ks_ptr, kz_ptr, vs_ptr, vz_ptr, D: tl.constexpr
):
    """Row ids and scales of one 32-position block (one INT2 page) for the folded INT2
    split: row [32]; value scales of each channel block's group vs0..vs3 [32] and zeros of
    every group vz [32, D // 32]; the page's key scales / zeros per channel block
    ks0..ks3, kz0..kz3 [1, D // 4] (broadcast over the query rows at use). fp16."""
    NG: tl.constexpr = D // 32
    Q: tl.constexpr = D // 4
    ph, row = _int2_page_rows(slot, live, int2_base, Hkv, h)
    so = row * NG
    vs0 = tl.load(vs_ptr + so + (0 * Q) // 32, mask=live, other=0.0)
    vs1 = tl.load(vs_ptr + so + (1 * Q) // 32, mask=live, other=0.0)
    vs2 = tl.load(vs_ptr + so + (2 * Q) // 32, mask=live, other=0.0)
    vs3 = tl.load(vs_ptr + so + (3 * Q) // 32, mask=live, other=0.0)
    vz = tl.load(vz_ptr + so[:, None] + tl.arange(0, NG)[None, :], mask=live[:, None], other=0.0)
    kc = ph * D + tl.arange(0, Q)[None, :]
    ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3 = _int2_key_planes(ks_ptr, kz_ptr, kc, Q)
    return row, vs0, vs1, vs2, vs3, vz, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3


@triton.jit
def _int2_fold_scale_tiles(
    slot,
    live,
    int2_base,
    Hkv,
    h,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    BLOCK_HQ: tl.constexpr,
    D: tl.constexpr,
):
    """As :func:`_int2_fold_scales`, every load a tile of at least 4 bytes per lane, which
    Triton's pipeliner can copy ahead asynchronously: the rows' value scales as one
    [32, D // 32] tile (each plane's group picked out in registers), the page's key scales
    and zeros of each plane in the query rows' shape [BLOCK_HQ, D // 4]."""
    NG: tl.constexpr = D // 32
    Q: tl.constexpr = D // 4
    ph, row = _int2_page_rows(slot, live, int2_base, Hkv, h)
    cng = tl.arange(0, NG)
    so = row[:, None] * NG + cng[None, :]
    vst = tl.load(vs_ptr + so, mask=live[:, None], other=0.0).to(tl.float32)
    # (not straight into the zero dot: an N = D / 32 operand is not copied ahead)
    vz = tl.where(live[:, None], tl.load(vz_ptr + so, mask=live[:, None], other=0.0), 0.0)
    # the page's key scales / zeros of plane k read straight into the query rows' shape
    # [BLOCK_HQ, Q] (every row the same; 8 bytes a lane where a [1, Q] read has 2)
    kc = ph * D + 0 * tl.arange(0, BLOCK_HQ)[:, None] + tl.arange(0, Q)[None, :]
    vs0 = tl.sum(tl.where(cng[None, :] == (0 * Q) // 32, vst, 0.0), 1).to(tl.float16)
    vs1 = tl.sum(tl.where(cng[None, :] == (1 * Q) // 32, vst, 0.0), 1).to(tl.float16)
    vs2 = tl.sum(tl.where(cng[None, :] == (2 * Q) // 32, vst, 0.0), 1).to(tl.float16)
    vs3 = tl.sum(tl.where(cng[None, :] == (3 * Q) // 32, vst, 0.0), 1).to(tl.float16)
    ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3 = _int2_key_planes(ks_ptr, kz_ptr, kc, Q)
    return row, vs0, vs1, vs2, vs3, vz, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3


@triton.jit
def _int2_fold_codes(row, live, k_ptr, v_ptr, D: tl.constexpr, V_WORDS: tl.constexpr):
    """Key code bytes [32, D // 4] and value codes (int32 words [32, D // 16] with V_WORDS,
    else bytes [32, D // 4]) of one block's rows; dead rows are not read."""
    Q: tl.constexpr = D // 4
    lm = live[:, None]
    kb = tl.load(k_ptr + row[:, None] * Q + tl.arange(0, Q)[None, :], mask=lm, other=0)
    if V_WORDS:
        cw = tl.arange(0, Q // 4)
        vv = tl.load(
            v_ptr.to(tl.pointer_type(tl.int32)) + row[:, None] * (Q // 4) + cw[None, :],
            mask=lm,
            other=0,
        )
    else:
        vv = tl.load(v_ptr + row[:, None] * Q + tl.arange(0, Q)[None, :], mask=lm, other=0)
    return kb, vv


@triton.jit
def _store_planes(ptrs, x0, x1, x2, x3, z0, z1, z2, z3, inv, m, Q: tl.constexpr):
    """Store accumulators of planes 0..3 (codes came as ``(n << 2k) 2**-24``) at ptrs + kQ."""
    tl.store(ptrs, (x0 * 16777216.0 + z0) * inv, mask=m)
    tl.store(ptrs + Q, (x1 * 4194304.0 + z1) * inv, mask=m)
    tl.store(ptrs + 2 * Q, (x2 * 1048576.0 + z2) * inv, mask=m)
    tl.store(ptrs + 3 * Q, (x3 * 262144.0 + z3) * inv, mask=m)


@triton.jit
def _int2_split_folded(
    q_ptr,
    stride_qb,
    stride_qh,
    slot_row,
    hm_row,
    k_ptr,
    v_ptr,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    po_ptr,
    plse_ptr,
    qk_scale,
    dead_id,
    int2_base,
    Hkv,
    b,
    h,
    s,
    start,
    end,
    S_total,
    G: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    D: tl.constexpr,
    HAS_HEAD_MASK: tl.constexpr,
    IEEE_F32: tl.constexpr,
    USE_ASM: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    V_WORDS: tl.constexpr,
    PREFETCH: tl.constexpr,
    PIPELINED: tl.constexpr,
):
    """One INT2 split with every scale folded out of the codes (``int2_fold``).

    Per 32-position page block and channel plane ``k`` (channels ``[kQ, (k+1)Q)``, Q = D/4;
    bit pair k of each code byte): keys ``q.k = sum_k (q_k * ks_k) . c_k + q . kz`` with the
    page's per-channel scale / zero; values ``sum_t p_t v_t = sum_t (p_t vs_tk) c_tk +
    sum_t p_t vz_tk`` with each token's group scale / zero (plane k lies in group kQ / 32).
    The codes enter both dots as the fp16 subnormals ``n * 2**-24`` (one ``and`` per code,
    no magic number, no fma, no per-element scale), the 2**24 applied after the key dot and
    at the store. The GQA group is unpadded (BLOCK_HQ rows) and operands are fp16.

    V_WORDS: the value codes are read as int32 words and each (byte, bit pair) of a word
    becomes its own dot operand, codes left in place (``(n << 2k) 2**-24``: one byte
    permute per byte and one ``and`` per code pair, no shift; 16 dots of N = Q / 4, the
    2**-2k undone at the store), made straight in the MMA operand layout.

    PIPELINED (``int2_pipelined``): no prefetch by hand; the code and scale loads of a
    block are tiles Triton's pipeliner copies ahead asynchronously (``num_stages`` >= 3:
    one block ahead, double-buffered)."""
    NG: tl.constexpr = D // 32
    Q: tl.constexpr = D // 4
    QW: tl.constexpr = Q // 4
    offs_g = tl.arange(0, BLOCK_HQ)
    gmask = offs_g < G
    qrow = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh
    cq = tl.arange(0, Q)
    hq = gmask[:, None]
    qf0 = tl.load(qrow + cq[None, :], mask=hq, other=0.0).to(tl.float32)
    qf1 = tl.load(qrow + cq[None, :] + Q, mask=hq, other=0.0).to(tl.float32)
    qf2 = tl.load(qrow + cq[None, :] + 2 * Q, mask=hq, other=0.0).to(tl.float32)
    qf3 = tl.load(qrow + cq[None, :] + 3 * Q, mask=hq, other=0.0).to(tl.float32)
    key_one = qk_scale * 16777216.0
    m_i = tl.full([BLOCK_HQ], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_HQ], tl.float32)
    if V_WORDS:  # accumulator 4 i + k: channel kQ + 4w + i in column w
        a0 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        a1 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        a2 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        a3 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        b0 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        b1 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        b2 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        b3 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        c0 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        c1 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        c2 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        c3 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        d0 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        d1 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        d2 = tl.zeros([BLOCK_HQ, QW], tl.float32)
        d3 = tl.zeros([BLOCK_HQ, QW], tl.float32)
    else:
        a0 = tl.zeros([BLOCK_HQ, Q], tl.float32)
        a1 = tl.zeros([BLOCK_HQ, Q], tl.float32)
        a2 = tl.zeros([BLOCK_HQ, Q], tl.float32)
        a3 = tl.zeros([BLOCK_HQ, Q], tl.float32)
    zb = tl.zeros([BLOCK_HQ, NG], tl.float32)
    ar = tl.arange(0, 32)
    cw = tl.arange(0, QW)
    cng = tl.arange(0, NG)
    # hand prefetch: the page's scales one block ahead, slots two; codes are loaded at the
    # top of their iteration (double-buffering them too was slower on the H100: 243
    # registers, 195 vs 157 µs at B=8 N=32k)
    if PREFETCH and not PIPELINED:
        slot_c, live = _live_positions(slot_row, hm_row, start + ar, end, dead_id, HAS_HEAD_MASK)
        row, vs0, vs1, vs2, vs3, vz, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3 = _int2_fold_scales(
            slot_c, live, int2_base, Hkv, h, ks_ptr, kz_ptr, vs_ptr, vz_ptr, D
        )
        slot_n, live_n = _live_positions(
            slot_row, hm_row, start + 32 + ar, end, dead_id, HAS_HEAD_MASK
        )
    for start_n in range(start, end, 32):
        if PREFETCH and not PIPELINED:
            slot_nn, live_nn = _live_positions(
                slot_row, hm_row, start_n + 64 + ar, end, dead_id, HAS_HEAD_MASK
            )
            (nrow, nvs0, nvs1, nvs2, nvs3, nvz, nks0, nks1, nks2, nks3, nkz0, nkz1, nkz2, nkz3) = (
                _int2_fold_scales(
                    slot_n, live_n, int2_base, Hkv, h, ks_ptr, kz_ptr, vs_ptr, vz_ptr, D
                )
            )
        else:  # this block's slots and scales, loaded here (PIPELINED: copied ahead)
            slot_c, live = _live_positions(
                slot_row, hm_row, start_n + ar, end, dead_id, HAS_HEAD_MASK
            )
            if PIPELINED:
                (row, vs0, vs1, vs2, vs3, vz, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3) = (
                    _int2_fold_scale_tiles(
                        slot_c, live, int2_base, Hkv, h, ks_ptr, kz_ptr, vs_ptr, vz_ptr, BLOCK_HQ, D
                    )
                )
            else:
                (row, vs0, vs1, vs2, vs3, vz, ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3) = (
                    _int2_fold_scales(
                        slot_c, live, int2_base, Hkv, h, ks_ptr, kz_ptr, vs_ptr, vz_ptr, D
                    )
                )
        kb, vv = _int2_fold_codes(row, live, k_ptr, v_ptr, D, V_WORDS)
        qz = tl.sum(
            qf0 * kz0.to(tl.float32)
            + qf1 * kz1.to(tl.float32)
            + qf2 * kz2.to(tl.float32)
            + qf3 * kz3.to(tl.float32),
            1,
        )
        u0, u1, u2, u3 = int2_code_quads_subnormal(kb, USE_ASM)
        sc = _mma((qf0 * ks0.to(tl.float32)).to(tl.float16), tl.trans(u0), IEEE_F32)
        sc = _mma_acc((qf1 * ks1.to(tl.float32)).to(tl.float16), tl.trans(u1), sc, IEEE_F32)
        sc = _mma_acc((qf2 * ks2.to(tl.float32)).to(tl.float16), tl.trans(u2), sc, IEEE_F32)
        sc = _mma_acc((qf3 * ks3.to(tl.float32)).to(tl.float16), tl.trans(u3), sc, IEEE_F32)
        qk = sc * key_one + (qz * qk_scale)[:, None]
        qk = tl.where(live[None, :], qk, float("-inf"))
        if LAZY_RESCALE:  # as the INT4 stacked path: rescale only when the max moves > 2**4
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            if tl.max(m_new - m_i, 0) > 4.0:
                alpha = tl.exp2(m_i - m_new)
                al = alpha[:, None]
                l_i = l_i * alpha
                zb = zb * al
                a0, a1, a2, a3 = a0 * al, a1 * al, a2 * al, a3 * al
                if V_WORDS:
                    b0, b1, b2, b3 = b0 * al, b1 * al, b2 * al, b3 * al
                    c0, c1, c2, c3 = c0 * al, c1 * al, c2 * al, c3 * al
                    d0, d1, d2, d3 = d0 * al, d1 * al, d2 * al, d3 * al
                m_i = m_new
            p = tl.exp2(qk - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
            al = alpha[:, None]
            zb = zb * al
            a0, a1, a2, a3 = a0 * al, a1 * al, a2 * al, a3 * al
            if V_WORDS:
                b0, b1, b2, b3 = b0 * al, b1 * al, b2 * al, b3 * al
                c0, c1, c2, c3 = c0 * al, c1 * al, c2 * al, c3 * al
                d0, d1, d2, d3 = d0 * al, d1 * al, d2 * al, d3 * al
        p16 = p.to(tl.float16)
        zb = _mma_acc(p16, vz, zb, IEEE_F32)
        if V_WORDS:  # accumulator letter = byte i, digit = plane k
            pv0 = p16 * vs0[None, :]
            pv1 = p16 * vs1[None, :]
            pv2 = p16 * vs2[None, :]
            pv3 = p16 * vs3[None, :]
            w00, w01, w02, w03, w10, w11, w12, w13, w20, w21, w22, w23, w30, w31, w32, w33 = (
                int2_word_planes_f16(vv, USE_ASM)
            )
            a0 = _mma_acc(pv0, w00, a0, IEEE_F32)
            a1 = _mma_acc(pv1, w01, a1, IEEE_F32)
            a2 = _mma_acc(pv2, w02, a2, IEEE_F32)
            a3 = _mma_acc(pv3, w03, a3, IEEE_F32)
            b0 = _mma_acc(pv0, w10, b0, IEEE_F32)
            b1 = _mma_acc(pv1, w11, b1, IEEE_F32)
            b2 = _mma_acc(pv2, w12, b2, IEEE_F32)
            b3 = _mma_acc(pv3, w13, b3, IEEE_F32)
            c0 = _mma_acc(pv0, w20, c0, IEEE_F32)
            c1 = _mma_acc(pv1, w21, c1, IEEE_F32)
            c2 = _mma_acc(pv2, w22, c2, IEEE_F32)
            c3 = _mma_acc(pv3, w23, c3, IEEE_F32)
            d0 = _mma_acc(pv0, w30, d0, IEEE_F32)
            d1 = _mma_acc(pv1, w31, d1, IEEE_F32)
            d2 = _mma_acc(pv2, w32, d2, IEEE_F32)
            d3 = _mma_acc(pv3, w33, d3, IEEE_F32)
        else:
            v0, v1, v2, v3 = int2_code_quads_subnormal(vv, USE_ASM)
            a0 = _mma_acc(p16 * vs0[None, :], v0, a0, IEEE_F32)
            a1 = _mma_acc(p16 * vs1[None, :], v1, a1, IEEE_F32)
            a2 = _mma_acc(p16 * vs2[None, :], v2, a2, IEEE_F32)
            a3 = _mma_acc(p16 * vs3[None, :], v3, a3, IEEE_F32)
        if PREFETCH and not PIPELINED:
            row, vz, live = nrow, nvz, live_n
            vs0, vs1, vs2, vs3 = nvs0, nvs1, nvs2, nvs3
            ks0, ks1, ks2, ks3 = nks0, nks1, nks2, nks3
            kz0, kz1, kz2, kz3 = nkz0, nkz1, nkz2, nkz3
            slot_n, live_n = slot_nn, live_nn
    inv = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    row_o = (b * (Hkv * G) + h * G + offs_g).to(tl.int64) * S_total + s
    prow = po_ptr + row_o[:, None] * D + cq[None, :]
    zg0 = tl.sum(tl.where(cng[None, :] == (0 * Q) // 32, zb, 0.0), 1)[:, None]
    zg1 = tl.sum(tl.where(cng[None, :] == (1 * Q) // 32, zb, 0.0), 1)[:, None]
    zg2 = tl.sum(tl.where(cng[None, :] == (2 * Q) // 32, zb, 0.0), 1)[:, None]
    zg3 = tl.sum(tl.where(cng[None, :] == (3 * Q) // 32, zb, 0.0), 1)[:, None]
    one = 16777216.0
    if V_WORDS:  # plane k's codes came as n << 2k
        iv = inv[:, None]
        pw = po_ptr + row_o[:, None] * D + 4 * cw[None, :]
        _store_planes(pw, a0, a1, a2, a3, zg0, zg1, zg2, zg3, iv, hq, Q)
        _store_planes(pw + 1, b0, b1, b2, b3, zg0, zg1, zg2, zg3, iv, hq, Q)
        _store_planes(pw + 2, c0, c1, c2, c3, zg0, zg1, zg2, zg3, iv, hq, Q)
        _store_planes(pw + 3, d0, d1, d2, d3, zg0, zg1, zg2, zg3, iv, hq, Q)
    else:
        tl.store(prow, (a0 * one + zg0) * inv[:, None], mask=hq)
        tl.store(prow + Q, (a1 * one + zg1) * inv[:, None], mask=hq)
        tl.store(prow + 2 * Q, (a2 * one + zg2) * inv[:, None], mask=hq)
        tl.store(prow + 3 * Q, (a3 * one + zg3) * inv[:, None], mask=hq)
    _store_lse(plse_ptr, row_o, m_i, l_i, gmask)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    slot_ptr,
    stride_sb,
    stride_sh,
    seq_lens_ptr,
    int2_lens_ptr,
    int4_lens_ptr,
    stride_lb,
    stride_lh,
    hm_ptr,
    stride_hb,
    stride_hh,
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
    q4_slot_rows,
    q4_head_rows,
    q2k_ptr,
    q2v_ptr,
    q2ks_ptr,
    q2kz_ptr,
    q2vs_ptr,
    q2vz_ptr,
    po_ptr,
    plse_ptr,
    qk_scale,
    dead_id,
    int4_base,
    int2_base,
    Hkv,
    split_len2,
    split_len4,
    split_lenf,
    S2,
    S4,
    S_total,
    P4,
    K4,
    s_first,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    D: tl.constexpr,
    BN_FULL: tl.constexpr,
    BN_INT4: tl.constexpr,
    HAS_FULL: tl.constexpr,
    HAS_INT4: tl.constexpr,
    HAS_INT2: tl.constexpr,
    HAS_HEAD_MASK: tl.constexpr,
    HAS_KCS: tl.constexpr,
    IEEE_F32: tl.constexpr,
    USE_ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    V_FOLD: tl.constexpr,
    INT4_LEGACY: tl.constexpr,
    STACKED: tl.constexpr,
    KEY_IMMA: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
    V_SUBNORMAL: tl.constexpr = False,
    V_DOTS8: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
    INT2_FOLD: tl.constexpr = False,
    INT2_V_WORDS: tl.constexpr = False,
    INT4_LIVE_FROM_SCALES: tl.constexpr = False,
    HEADS_FASTEST: tl.constexpr = False,
    V_CENTRED: tl.constexpr = False,
    INT4_V_SCALES_BY_DOT: tl.constexpr = False,
    INT4_SCALE_STRIDE: tl.constexpr = 0,  # the INT4 scales' row stride (the wrapper passes it)
    INT4_SCALE_TILE: tl.constexpr = False,
    INT2_PIPELINED: tl.constexpr = False,
    INT2_LAZY_RESCALE: tl.constexpr = False,
    INT4_CHUNKS: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
    INT2_ELSEWHERE: tl.constexpr = False,
    INT4_ELSEWHERE: tl.constexpr = False,
    WAIT_PRIOR: tl.constexpr = False,
):
    NG: tl.constexpr = D // 32
    Q: tl.constexpr = D // 4
    if LAUNCH_DEPENDENTS:  # the merge (a programmatic dependent launch) may start now
        gdc_launch_dependents()
    if HEADS_FASTEST:
        h = tl.program_id(0)
        s = tl.program_id(1)
    else:
        s = tl.program_id(0)
        h = tl.program_id(1)
    b = tl.program_id(2)
    s += s_first  # the launch's first program (past the splits that run elsewhere)

    len_off = b * stride_lb + h * stride_lh
    seq_len = tl.load(seq_lens_ptr + len_off)
    n2 = 0
    n4 = 0
    if HAS_INT2 or INT2_ELSEWHERE:  # INT2_ELSEWHERE: the segment's splits are another launch's
        n2 = tl.load(int2_lens_ptr + len_off)
    if HAS_INT4 or INT4_ELSEWHERE:
        n4 = tl.load(int4_lens_ptr + len_off)
    # programs: S2 INT2 splits (a partial row each), P4 INT4 programs of K4 chunks of
    # split_len4 positions (a partial row per chunk: S4 rows), then the full segment's splits
    is2 = s < S2
    is4 = (s >= S2) & (s < S2 + P4)
    seg_start = tl.where(is2, 0, tl.where(is4, n2, n2 + n4))
    seg_end = tl.where(is2, n2, tl.where(is4, n2 + n4, seq_len))
    local = tl.where(is2, s, tl.where(is4, s - S2, s - S2 - P4))
    split_len = tl.where(is2, split_len2, tl.where(is4, split_len4 * K4, split_lenf))
    start = seg_start + local * split_len
    end = tl.minimum(start + split_len, seg_end)
    s = tl.where(is2, s, tl.where(is4, S2 + local * K4, S2 + S4 + local))  # its first row

    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < G
    offs_d = tl.arange(0, D)
    q_rows = q_ptr + b * stride_qb + (h * G + offs_h)[:, None] * stride_qh
    slot_row = slot_ptr + b.to(tl.int64) * stride_sb + h * stride_sh
    hm_row = hm_ptr + b.to(tl.int64) * stride_hb + h * stride_hh
    row_o = (b * (Hkv * G) + h * G + offs_h).to(tl.int64) * S_total + s
    dt = q_ptr.dtype.element_ty

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)

    # Quantized pools: raw loads are double-buffered by hand (slots two blocks ahead, data
    # one block ahead) because the compiler's pipeliner does not prefetch non-dot loads.
    # Every dequantized tile is a contiguous run of code bytes per row whose scale is one
    # value per row, so it unpacks in registers with packed 16-bit math (see packing.py).
    # constexpr guard outside, runtime branch inside: Triton must not fuse the two
    if HAS_INT2 and INT2_FOLD:  # noqa: SIM102
        if is2:
            _int2_split_folded(
                q_ptr,
                stride_qb,
                stride_qh,
                slot_row,
                hm_row,
                q2k_ptr,
                q2v_ptr,
                q2ks_ptr,
                q2kz_ptr,
                q2vs_ptr,
                q2vz_ptr,
                po_ptr,
                plse_ptr,
                qk_scale,
                dead_id,
                int2_base,
                Hkv,
                b,
                h,
                s,
                start,
                end,
                S_total,
                G,
                BLOCK_HQ,
                D,
                HAS_HEAD_MASK,
                IEEE_F32,
                USE_ASM,
                INT2_LAZY_RESCALE,
                INT2_V_WORDS,
                PREFETCH,
                INT2_PIPELINED,
            )
    if HAS_INT2 and not INT2_FOLD:  # noqa: SIM102
        if is2:
            # the GQA group unpadded (BLOCK_HQ rows); 16-bit operands in fp16 (11-bit
            # mantissa) whatever the query dtype: q * page scale and p are rounded once
            offs_g2 = tl.arange(0, BLOCK_HQ)
            hmask2 = offs_g2 < G
            q_rows2 = q_ptr + b * stride_qb + (h * G + offs_g2)[:, None] * stride_qh
            row_o2 = (b * (Hkv * G) + h * G + offs_g2).to(tl.int64) * S_total + s
            m2i = tl.full([BLOCK_HQ], -1.0e30, tl.float32)
            l2i = tl.zeros([BLOCK_HQ], tl.float32)
            cq = tl.arange(0, Q)
            hq = hmask2[:, None]
            qf0 = tl.load(q_rows2 + cq[None, :], mask=hq, other=0.0).to(tl.float32)
            qf1 = tl.load(q_rows2 + cq[None, :] + Q, mask=hq, other=0.0).to(tl.float32)
            qf2 = tl.load(q_rows2 + cq[None, :] + 2 * Q, mask=hq, other=0.0).to(tl.float32)
            qf3 = tl.load(q_rows2 + cq[None, :] + 3 * Q, mask=hq, other=0.0).to(tl.float32)
            a0 = tl.zeros([BLOCK_HQ, Q], tl.float32)
            a1 = tl.zeros([BLOCK_HQ, Q], tl.float32)
            a2 = tl.zeros([BLOCK_HQ, Q], tl.float32)
            a3 = tl.zeros([BLOCK_HQ, Q], tl.float32)
            ar = tl.arange(0, 32)
            if PREFETCH:
                slot_c, live = _live_positions(
                    slot_row, hm_row, start + ar, end, dead_id, HAS_HEAD_MASK
                )
                (
                    kb,
                    vb,
                    vs0,
                    vz0,
                    vs1,
                    vz1,
                    vs2,
                    vz2,
                    vs3,
                    vz3,
                    ks0,
                    ks1,
                    ks2,
                    ks3,
                    kz0,
                    kz1,
                    kz2,
                    kz3,
                ) = _int2_page_loads(
                    slot_c,
                    live,
                    int2_base,
                    Hkv,
                    h,
                    q2k_ptr,
                    q2v_ptr,
                    q2ks_ptr,
                    q2kz_ptr,
                    q2vs_ptr,
                    q2vz_ptr,
                    BLOCK_H,
                    D,
                )
                slot_n, live_n = _live_positions(
                    slot_row, hm_row, start + 32 + ar, end, dead_id, HAS_HEAD_MASK
                )
            for start_n in range(start, end, 32):
                if PREFETCH:
                    slot_nn, live_nn = _live_positions(
                        slot_row, hm_row, start_n + 64 + ar, end, dead_id, HAS_HEAD_MASK
                    )
                    (
                        nkb,
                        nvb,
                        nvs0,
                        nvz0,
                        nvs1,
                        nvz1,
                        nvs2,
                        nvz2,
                        nvs3,
                        nvz3,
                        nks0,
                        nks1,
                        nks2,
                        nks3,
                        nkz0,
                        nkz1,
                        nkz2,
                        nkz3,
                    ) = _int2_page_loads(
                        slot_n,
                        live_n,
                        int2_base,
                        Hkv,
                        h,
                        q2k_ptr,
                        q2v_ptr,
                        q2ks_ptr,
                        q2kz_ptr,
                        q2vs_ptr,
                        q2vz_ptr,
                        BLOCK_H,
                        D,
                    )
                else:
                    slot_c, live = _live_positions(
                        slot_row, hm_row, start_n + ar, end, dead_id, HAS_HEAD_MASK
                    )
                    (
                        kb,
                        vb,
                        vs0,
                        vz0,
                        vs1,
                        vz1,
                        vs2,
                        vz2,
                        vs3,
                        vz3,
                        ks0,
                        ks1,
                        ks2,
                        ks3,
                        kz0,
                        kz1,
                        kz2,
                        kz3,
                    ) = _int2_page_loads(
                        slot_c,
                        live,
                        int2_base,
                        Hkv,
                        h,
                        q2k_ptr,
                        q2v_ptr,
                        q2ks_ptr,
                        q2kz_ptr,
                        q2vs_ptr,
                        q2vz_ptr,
                        BLOCK_H,
                        D,
                    )
                # keys: the page's per-channel scale folded into q, its zero into a row bias
                qz = tl.sum(
                    qf0 * kz0.to(tl.float32)
                    + qf1 * kz1.to(tl.float32)
                    + qf2 * kz2.to(tl.float32)
                    + qf3 * kz3.to(tl.float32),
                    1,
                )
                u0, u1, u2, u3 = int2_code_quads(kb, tl.float16, USE_ASM)
                qk = _mma((qf0 * ks0.to(tl.float32)).to(tl.float16), tl.trans(u0), IEEE_F32)
                qk += _mma((qf1 * ks1.to(tl.float32)).to(tl.float16), tl.trans(u1), IEEE_F32)
                qk += _mma((qf2 * ks2.to(tl.float32)).to(tl.float16), tl.trans(u2), IEEE_F32)
                qk += _mma((qf3 * ks3.to(tl.float32)).to(tl.float16), tl.trans(u3), IEEE_F32)
                qk = (qk + qz[:, None]) * qk_scale
                qk = tl.where(live[None, :], qk, float("-inf"))
                p, alpha, m2i, l2i = _online_softmax(qk, m2i, l2i)
                pb = p.to(tl.float16)
                v0, v1, v2, v3 = dequant_int2_quads(
                    vb,
                    _bcast_rows(vs0, u0),
                    _bcast_rows(vz0, u0),
                    _bcast_rows(vs1, u0),
                    _bcast_rows(vz1, u0),
                    _bcast_rows(vs2, u0),
                    _bcast_rows(vz2, u0),
                    _bcast_rows(vs3, u0),
                    _bcast_rows(vz3, u0),
                    USE_ASM,
                )
                a0 = a0 * alpha[:, None] + _mma(pb, v0, IEEE_F32)
                a1 = a1 * alpha[:, None] + _mma(pb, v1, IEEE_F32)
                a2 = a2 * alpha[:, None] + _mma(pb, v2, IEEE_F32)
                a3 = a3 * alpha[:, None] + _mma(pb, v3, IEEE_F32)
                if PREFETCH:
                    live = live_n
                    kb, vb = nkb, nvb
                    vs0, vz0, vs1, vz1, vs2, vz2, vs3, vz3 = (
                        nvs0,
                        nvz0,
                        nvs1,
                        nvz1,
                        nvs2,
                        nvz2,
                        nvs3,
                        nvz3,
                    )
                    ks0, ks1, ks2, ks3, kz0, kz1, kz2, kz3 = (
                        nks0,
                        nks1,
                        nks2,
                        nks3,
                        nkz0,
                        nkz1,
                        nkz2,
                        nkz3,
                    )
                    slot_n, live_n = slot_nn, live_nn
            _store_partial(po_ptr, row_o2, cq, a0, l2i, hmask2, D)
            _store_partial(po_ptr, row_o2, cq + Q, a1, l2i, hmask2, D)
            _store_partial(po_ptr, row_o2, cq + 2 * Q, a2, l2i, hmask2, D)
            _store_partial(po_ptr, row_o2, cq + 3 * Q, a3, l2i, hmask2, D)
            _store_lse(plse_ptr, row_o2, m2i, l2i, hmask2)
    if HAS_INT4:  # noqa: SIM102
        if INT4_LEGACY:  # noqa: SIM102
            if is4:
                c2 = 2 * tl.arange(0, D // 2)
                hm2 = hmask[:, None]
                qe = tl.load(q_rows + c2[None, :], mask=hm2, other=0.0)
                qo = tl.load(q_rows + c2[None, :] + 1, mask=hm2, other=0.0)
                if HAS_KCS:  # keys stored divided by a per-channel power of two: fold it into q
                    ce = tl.load(q4c_ptr + h * D + c2)
                    cod = tl.load(q4c_ptr + h * D + c2 + 1)
                    qe = (qe.to(tl.float32) * ce[None, :]).to(dt)
                    qo = (qo.to(tl.float32) * cod[None, :]).to(dt)
                ae = tl.zeros([BLOCK_H, D // 2], tl.float32)
                ao = tl.zeros([BLOCK_H, D // 2], tl.float32)
                ar = tl.arange(0, BN_INT4)
                if PREFETCH:
                    slot_c, live_c = _live_positions(
                        slot_row, hm_row, start + ar, end, dead_id, HAS_HEAD_MASK
                    )
                    kb, vb, ks, kz, vs, vz = _int4_block(
                        slot_c,
                        live_c,
                        int4_base,
                        q4_slot_rows,
                        h * q4_head_rows,
                        q4k_ptr,
                        q4v_ptr,
                        q4ks_ptr,
                        q4kz_ptr,
                        q4vs_ptr,
                        q4vz_ptr,
                        D,
                        NG,
                        INT4_SCALE_STRIDE,
                    )
                    slot_n, live_n = _live_positions(
                        slot_row, hm_row, start + BN_INT4 + ar, end, dead_id, HAS_HEAD_MASK
                    )
                for start_n in range(start, end, BN_INT4):
                    if PREFETCH:
                        slot_nn, live_nn = _live_positions(
                            slot_row,
                            hm_row,
                            start_n + 2 * BN_INT4 + ar,
                            end,
                            dead_id,
                            HAS_HEAD_MASK,
                        )
                        nkb, nvb, nks, nkz, nvs, nvz = _int4_block(
                            slot_n,
                            live_n,
                            int4_base,
                            q4_slot_rows,
                            h * q4_head_rows,
                            q4k_ptr,
                            q4v_ptr,
                            q4ks_ptr,
                            q4kz_ptr,
                            q4vs_ptr,
                            q4vz_ptr,
                            D,
                            NG,
                            INT4_SCALE_STRIDE,
                        )
                    else:
                        slot_c, live_c = _live_positions(
                            slot_row, hm_row, start_n + ar, end, dead_id, HAS_HEAD_MASK
                        )
                        kb, vb, ks, kz, vs, vz = _int4_block(
                            slot_c,
                            live_c,
                            int4_base,
                            q4_slot_rows,
                            h * q4_head_rows,
                            q4k_ptr,
                            q4v_ptr,
                            q4ks_ptr,
                            q4kz_ptr,
                            q4vs_ptr,
                            q4vz_ptr,
                            D,
                            NG,
                            INT4_SCALE_STRIDE,
                        )
                    ke, ko = dequant_int4_pairs(
                        kb,
                        _bcast_groups(ks.to(dt), BN_INT4, NG, 16),
                        _bcast_groups(kz.to(dt), BN_INT4, NG, 16),
                        USE_ASM,
                    )
                    qk = _mma(qe, tl.trans(ke), IEEE_F32) + _mma(qo, tl.trans(ko), IEEE_F32)
                    qk = qk * qk_scale
                    qk = tl.where(live_c[None, :], qk, float("-inf"))
                    p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
                    pb = p.to(dt)
                    ve, vo = dequant_int4_pairs(
                        vb,
                        _bcast_groups(vs.to(dt), BN_INT4, NG, 16),
                        _bcast_groups(vz.to(dt), BN_INT4, NG, 16),
                        USE_ASM,
                    )
                    ae = ae * alpha[:, None] + _mma(pb, ve, IEEE_F32)
                    ao = ao * alpha[:, None] + _mma(pb, vo, IEEE_F32)
                    if PREFETCH:
                        live_c = live_n
                        kb, vb, ks, kz, vs, vz = nkb, nvb, nks, nkz, nvs, nvz
                        slot_n, live_n = slot_nn, live_nn
                c2h = 2 * tl.arange(0, D // 2)
                _store_partial(po_ptr, row_o, c2h, ae, l_i, hmask, D)
                _store_partial(po_ptr, row_o, c2h + 1, ao, l_i, hmask, D)
                _store_lse(plse_ptr, row_o, m_i, l_i, hmask)
        else:
            if is4:
                if STACKED:
                    _int4_split_stacked(
                        q_ptr,
                        stride_qb,
                        stride_qh,
                        slot_row,
                        hm_row,
                        q4k_ptr,
                        q4v_ptr,
                        q4ks_ptr,
                        q4kz_ptr,
                        q4vs_ptr,
                        q4vz_ptr,
                        q4c_ptr,
                        po_ptr,
                        plse_ptr,
                        qk_scale,
                        dead_id,
                        int4_base,
                        q4_slot_rows,
                        q4_head_rows,
                        Hkv,
                        b,
                        h,
                        s,
                        start,
                        end,
                        S_total,
                        split_len4,
                        tl.minimum(K4, S2 + S4 - s),  # the last program's rows may be fewer
                        G,
                        BLOCK_HQ,
                        D,
                        BN_INT4,
                        HAS_HEAD_MASK,
                        HAS_KCS,
                        IEEE_F32,
                        USE_ASM,
                        KEY_IMMA,
                        LAZY_RESCALE,
                        V_SUBNORMAL,
                        V_DOTS8,
                        OFFS32,
                        INT4_LIVE_FROM_SCALES,
                        V_CENTRED,
                        INT4_V_SCALES_BY_DOT,
                        INT4_SCALE_STRIDE,
                        INT4_SCALE_TILE,
                        INT4_CHUNKS,
                    )
                else:
                    # Scales folded out of the inner loop: per token t and 32-channel group g,
                    # q.k = s_tg (q_g . c_tg) + z_tg sum(q_g) and, for values,
                    # sum_t p_t v_t = sum_t (p_t s_tg) c_tg + sum_t p_t z_tg: the codes c only need
                    # an exact int -> 16-bit conversion. One group is 16 bytes of a row: low nibbles
                    # the even channels, high nibbles the odd ones. The GQA group is not padded.
                    offs_g = tl.arange(0, BLOCK_HQ)
                    gmask = offs_g < G
                    q4_rows = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh
                    qe0, qo0, qs0 = _q_int4_group(q4_rows, gmask, q4c_ptr, h, 0, D, HAS_KCS, dt)
                    qe1, qo1, qs1 = _q_int4_group(q4_rows, gmask, q4c_ptr, h, 1, D, HAS_KCS, dt)
                    qs0 = qs0 * qk_scale
                    qs1 = qs1 * qk_scale
                    if NG == 4:
                        qe2, qo2, qs2 = _q_int4_group(q4_rows, gmask, q4c_ptr, h, 2, D, HAS_KCS, dt)
                        qe3, qo3, qs3 = _q_int4_group(q4_rows, gmask, q4c_ptr, h, 3, D, HAS_KCS, dt)
                        qs2 = qs2 * qk_scale
                        qs3 = qs3 * qk_scale
                    m4 = tl.full([BLOCK_HQ], -1.0e30, tl.float32)
                    l4 = tl.zeros([BLOCK_HQ], tl.float32)
                    a00 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a01 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a02 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a03 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a10 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a11 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a12 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a13 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a20 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a21 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a22 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a23 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a30 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a31 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a32 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    a33 = tl.zeros([BLOCK_HQ, 8], tl.float32)
                    zb = tl.zeros([BLOCK_HQ, NG], tl.float32)
                    ave = tl.zeros([BLOCK_HQ, D // 2], tl.float32)
                    avo = tl.zeros([BLOCK_HQ, D // 2], tl.float32)
                    arn = tl.arange(0, BN_INT4)
                    j16 = tl.arange(0, 16)
                    cng = tl.arange(0, NG)
                    for start_n in range(start, end, BN_INT4):
                        slot, live = _live_positions(
                            slot_row, hm_row, start_n + arn, end, dead_id, HAS_HEAD_MASK
                        )
                        row = tl.where(live, slot - int4_base, 0) * q4_slot_rows + h * q4_head_rows
                        lm = live[:, None]
                        co = row[:, None] * (D // 2) + j16[None, :]
                        so = row * INT4_SCALE_STRIDE
                        kb0 = tl.load(q4k_ptr + co, mask=lm, other=0)
                        kb1 = tl.load(q4k_ptr + co + 16, mask=lm, other=0)
                        ks0 = tl.load(q4ks_ptr + so, mask=live, other=0.0).to(tl.float32)
                        ks1 = tl.load(q4ks_ptr + so + 1, mask=live, other=0.0).to(tl.float32)
                        kz0 = tl.load(q4kz_ptr + so, mask=live, other=0.0).to(tl.float32)
                        kz1 = tl.load(q4kz_ptr + so + 1, mask=live, other=0.0).to(tl.float32)
                        vz = tl.load(q4vz_ptr + so[:, None] + cng[None, :], mask=lm, other=0.0)
                        if V_FOLD:
                            cw = row[:, None] * (D // 8) + tl.arange(0, 4)[None, :]
                            vw_ptr = q4v_ptr.to(tl.pointer_type(tl.int32))
                            vb0 = tl.load(vw_ptr + cw, mask=lm, other=0)
                            vb1 = tl.load(vw_ptr + cw + 4, mask=lm, other=0)
                            vs0 = tl.load(q4vs_ptr + so, mask=live, other=0.0).to(tl.float32)
                            vs1 = tl.load(q4vs_ptr + so + 1, mask=live, other=0.0).to(tl.float32)
                            if NG == 4:
                                vb2 = tl.load(vw_ptr + cw + 8, mask=lm, other=0)
                                vb3 = tl.load(vw_ptr + cw + 12, mask=lm, other=0)
                                vs2 = tl.load(q4vs_ptr + so + 2, mask=live, other=0.0).to(
                                    tl.float32
                                )
                                vs3 = tl.load(q4vs_ptr + so + 3, mask=live, other=0.0).to(
                                    tl.float32
                                )
                        else:
                            vrow = tl.load(
                                q4v_ptr + row[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :],
                                mask=lm,
                                other=0,
                            )
                            vst = tl.load(q4vs_ptr + so[:, None] + cng[None, :], mask=lm, other=0.0)
                        if NG == 4:
                            kb2 = tl.load(q4k_ptr + co + 32, mask=lm, other=0)
                            kb3 = tl.load(q4k_ptr + co + 48, mask=lm, other=0)
                            ks2 = tl.load(q4ks_ptr + so + 2, mask=live, other=0.0).to(tl.float32)
                            ks3 = tl.load(q4ks_ptr + so + 3, mask=live, other=0.0).to(tl.float32)
                            kz2 = tl.load(q4kz_ptr + so + 2, mask=live, other=0.0).to(tl.float32)
                            kz3 = tl.load(q4kz_ptr + so + 3, mask=live, other=0.0).to(tl.float32)
                        # keys: one pair of exact-code dots per group, scale and zero applied after
                        qk = (
                            _int4_group_dots(kb0, qe0, qo0, dt, IEEE_F32, USE_ASM)
                            * (ks0 * qk_scale)[None, :]
                            + qs0[:, None] * kz0[None, :]
                        )
                        qk += (
                            _int4_group_dots(kb1, qe1, qo1, dt, IEEE_F32, USE_ASM)
                            * (ks1 * qk_scale)[None, :]
                            + qs1[:, None] * kz1[None, :]
                        )
                        if NG == 4:
                            qk += (
                                _int4_group_dots(kb2, qe2, qo2, dt, IEEE_F32, USE_ASM)
                                * (ks2 * qk_scale)[None, :]
                                + qs2[:, None] * kz2[None, :]
                            )
                            qk += (
                                _int4_group_dots(kb3, qe3, qo3, dt, IEEE_F32, USE_ASM)
                                * (ks3 * qk_scale)[None, :]
                                + qs3[:, None] * kz3[None, :]
                            )
                        qk = tl.where(live[None, :], qk, float("-inf"))
                        p, alpha, m4, l4 = _online_softmax(qk, m4, l4)
                        # values: sum_t p_t z_tg as one small dot, plus either (p * s_g) against the
                        # exact codes per group (V_FOLD) or p against fp16 dequantized rows
                        al = alpha[:, None]
                        zb = _mma_acc(p.to(tl.float16), vz, zb * al, IEEE_F32)
                        if V_FOLD:
                            a00, a01, a02, a03 = _int4_group_pv(
                                vb0,
                                p,
                                vs0,
                                a00 * al,
                                a01 * al,
                                a02 * al,
                                a03 * al,
                                IEEE_F32,
                                USE_ASM,
                            )
                            a10, a11, a12, a13 = _int4_group_pv(
                                vb1,
                                p,
                                vs1,
                                a10 * al,
                                a11 * al,
                                a12 * al,
                                a13 * al,
                                IEEE_F32,
                                USE_ASM,
                            )
                            if NG == 4:
                                a20, a21, a22, a23 = _int4_group_pv(
                                    vb2,
                                    p,
                                    vs2,
                                    a20 * al,
                                    a21 * al,
                                    a22 * al,
                                    a23 * al,
                                    IEEE_F32,
                                    USE_ASM,
                                )
                                a30, a31, a32, a33 = _int4_group_pv(
                                    vb3,
                                    p,
                                    vs3,
                                    a30 * al,
                                    a31 * al,
                                    a32 * al,
                                    a33 * al,
                                    IEEE_F32,
                                    USE_ASM,
                                )
                        else:
                            ve, vo = dequant_int4_pairs(
                                vrow,
                                _bcast_groups(vst, BN_INT4, NG, 16),
                                tl.zeros([BN_INT4, D // 2], tl.float16),
                                USE_ASM,
                            )
                            pv = p.to(tl.float16)
                            ave = _mma_acc(pv, ve, ave * al, IEEE_F32)
                            avo = _mma_acc(pv, vo, avo * al, IEEE_F32)
                    row_q = (b * (Hkv * G) + h * G + offs_g).to(tl.int64) * S_total + s
                    inv = 1.0 / tl.where(l4 > 0.0, l4, 1.0)
                    if V_FOLD:
                        _store_int4_group(
                            po_ptr, row_q, 0, a00, a01, a02, a03, zb, inv, gmask, D, NG
                        )
                        _store_int4_group(
                            po_ptr, row_q, 1, a10, a11, a12, a13, zb, inv, gmask, D, NG
                        )
                        if NG == 4:
                            _store_int4_group(
                                po_ptr, row_q, 2, a20, a21, a22, a23, zb, inv, gmask, D, NG
                            )
                            _store_int4_group(
                                po_ptr, row_q, 3, a30, a31, a32, a33, zb, inv, gmask, D, NG
                            )
                    else:
                        zr = _bcast_groups(zb, BLOCK_HQ, NG, 32)
                        out = (tl.interleave(ave, avo) + zr) * inv[:, None]
                        tl.store(
                            po_ptr + row_q[:, None] * D + offs_d[None, :], out, mask=gmask[:, None]
                        )
                    _store_lse(plse_ptr, row_q, m4, l4, gmask)
    if HAS_FULL:  # noqa: SIM102
        if s >= S2 + S4:
            q = tl.load(q_rows + offs_d[None, :], mask=hmask[:, None], other=0.0)
            acc = tl.zeros([BLOCK_H, D], tl.float32)
            for start_n in range(start, end, BN_FULL):
                offs_n = start_n + tl.arange(0, BN_FULL)
                slot, live = _live_positions(slot_row, hm_row, offs_n, end, dead_id, HAS_HEAD_MASK)
                fo = slot[:, None] * stride_fs + h * stride_fh + offs_d[None, :]
                k = tl.load(fk_ptr + fo, mask=live[:, None], other=0.0).to(dt)
                qk = _mma(q, tl.trans(k), IEEE_F32) * qk_scale
                qk = tl.where(live[None, :], qk, float("-inf"))
                p, alpha, m_i, l_i = _online_softmax(qk, m_i, l_i)
                v = tl.load(fv_ptr + fo, mask=live[:, None], other=0.0).to(dt)
                acc = _mma_acc(p.to(dt), v, acc * alpha[:, None], IEEE_F32)
            _store_partial(po_ptr, row_o, offs_d, acc, l_i, hmask, D)
            _store_lse(plse_ptr, row_o, m_i, l_i, hmask)

    if not HAS_FULL:  # noqa: SIM102
        if s >= S2 + S4:  # no segment at all (every bound 0): an empty split
            _store_lse(plse_ptr, row_o, m_i, l_i, hmask)
    if WAIT_PRIOR:  # a programmatic dependent of a Gluon split: complete after it
        gdc_wait()


@triton.jit
def _merge_splits_kernel(
    po_ptr,
    plse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    Hq,
    S_total,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,
):
    """Log-sum-exp merge of the split partials: grid (request x query head, D / BLOCK_D),
    each program one query head's BLOCK_D output channels.
    GDC_WAIT: launched as a programmatic dependent of the split kernel, so it first waits
    for that grid's completion and its stores (``griddepcontrol.wait``). A step's partial
    rows are loaded beside its log-sum-exps, not behind them (a split with nothing live,
    lse -inf, is dropped by a select after the load: its row may hold anything): one
    memory round trip per step instead of two."""
    pid = tl.program_id(0)
    b = pid // Hq
    hq = pid % Hq
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    base = pid.to(tl.int64) * S_total
    if GDC_WAIT:
        gdc_wait()
    m = tl.full([1], -1.0e30, tl.float32)
    den = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, S_total, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        sm = offs_s < S_total
        lse = tl.load(plse_ptr + base + offs_s, mask=sm, other=float("-inf"))
        po = tl.load(
            po_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=sm[:, None], other=0.0
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        po = tl.where((lse > float("-inf"))[:, None], po, 0.0)
        acc = acc * alpha + tl.sum(w[:, None] * po, 0)
        den = den * alpha + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + hq * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _device_properties(device: torch.device):
    """``device``'s CUDA properties (None off CUDA); cached per device
    (``torch.cuda.get_device_properties`` is a Python call)."""
    if device.type != "cuda":
        return None
    return _cuda_properties(
        device.index if device.index is not None else torch.cuda.current_device()
    )


def _pdl_capable(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches (CUDA, compute capability
    >= 9: Hopper and newer)."""
    props = _device_properties(device)
    return props is not None and props.major >= 9


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA)."""
    props = _device_properties(device)
    return props.multi_processor_count if props is not None else 4


def _use_gluon(
    wanted: bool | None,
    name: str,
    device: torch.device,
    head_dim: int,
    group: int,
    slot_dtype: torch.dtype,
    interpreting: bool,
    config_why: str | None = None,
) -> bool:
    """Whether a launch's INT2 / INT4 splits run on their Gluon kernel (``wanted``:
    ``DecodeConfig.int2_gluon`` / ``int4_gluon``, named ``name``; ``config_why``: what the
    config lacks for it, None if nothing)."""
    if wanted is False or interpreting:
        return False
    why = None
    props = _device_properties(device)
    if not GLUON_AVAILABLE or props is None or (props.major, props.minor) < MIN_CAPABILITY:
        why = "a CUDA device of compute capability >= 8.0 and a Triton with Gluon"
    elif head_dim != 128 or group > 8:
        why = f"head_dim 128 and a GQA group <= 8 (got {head_dim}, {group})"
    elif slot_dtype != torch.int32:
        why = f"an int32 slot map (got {slot_dtype})"
    else:
        why = config_why
    if why is not None:
        if wanted:
            raise ValueError(f"{name}=True needs {why}")
        return False
    return bool(wanted) or props.major >= 9


def _use_gluon_int2(
    cfg: DecodeConfig,
    device: torch.device,
    head_dim: int,
    group: int,
    slot_dtype: torch.dtype,
    interpreting: bool,
) -> bool:
    """Whether a launch's INT2 splits run on the Gluon kernel (``DecodeConfig.int2_gluon``)."""
    why = None if cfg.int2_fold else "int2_fold (the Gluon kernel is the folded INT2 split)"
    wanted = cfg.int2_gluon
    return _use_gluon(wanted, "int2_gluon", device, head_dim, group, slot_dtype, interpreting, why)


def _int4_pool_aligned(p4, sstride: int, interleaved: bool) -> bool:
    """Whether the Gluon INT4 split's ``cp.async`` copies fit the pool: codes and scale tensors
    starting on 16-byte boundaries, a row's scales (``sstride`` elements apart) in 8-byte
    runs (``interleaved``: 16-byte rows of ``[ks | kz | vs | vz]``)."""
    if interleaved:
        tensors, step = (p4.k, p4.v, p4.k_scale), 8
    else:
        tensors, step = (p4.k, p4.v, p4.k_scale, p4.k_zero, p4.v_scale, p4.v_zero), 4
    return sstride % step == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def _use_gluon_int4(
    cfg: DecodeConfig,
    device: torch.device,
    head_dim: int,
    group: int,
    slot_dtype: torch.dtype,
    interpreting: bool,
    int2_on_triton: bool = False,
    p4=None,
    sstride: int = 0,
    interleaved: bool = True,
) -> bool:
    """Whether a launch's INT4 splits run on the Gluon kernel (``DecodeConfig.int4_gluon``;
    ``int2_on_triton``: the launch's INT2 splits run on the Triton kernel, which then could
    not skip the INT4 ones; ``p4``: the INT4 pool, whose alignment
    (:func:`_int4_pool_aligned` with ``sstride`` and ``interleaved``) it checks; None: not
    checked; ``interleaved``: the pool's scales in one buffer, the layout it runs by
    default)."""
    wanted = cfg.int4_gluon
    if wanted is False or interpreting:
        return False
    why = "int4_legacy=False" if cfg.int4_legacy else None
    if why is None and int2_on_triton:
        why = "the INT2 splits on the Gluon kernel too (int2_gluon)"
    if why is None and p4 is not None and not _int4_pool_aligned(p4, sstride, interleaved):
        why = "INT4 pool tensors on 16-byte boundaries (see _int4_pool_aligned)"
    use = _use_gluon(wanted, "int4_gluon", device, head_dim, group, slot_dtype, interpreting, why)
    # by default only with the pool's interleaved scales: with four separate scale tensors
    # (a lane's 8-byte run per row and tensor) it ran 1.5x slower than the Triton split
    return use and (wanted is True or interleaved)


def _split_len(
    batch: int, num_kv_heads: int, total_len: int, sms: int, programs_per_sm: int, min_len: int
) -> int:
    n_splits = max(1, -(-(programs_per_sm * sms) // max(1, batch * num_kv_heads)))
    per = -(-max(1, total_len) // n_splits)
    per = -(-per // 64) * 64
    return max(per, min_len)


def resident_programs(
    n_regs: int,
    shared_bytes: int,
    num_warps: int,
    regs_per_sm: int = 65536,
    smem_per_sm: int = 233472,
) -> int:
    """Programs of a compiled kernel that one SM holds at once (CUDA's occupancy rules).

    Registers: a warp's come from one of the SM's four sub-partitions (a quarter of the
    register file each), in units of 8 per thread; so at 215 registers a sub-partition
    holds 2 one-warp programs: 8 per SM, not 65,536 / (216 x 32) = 9 (ncu's
    ``launch__occupancy_limit_registers`` agrees on the H100), and 168 registers are needed
    for 12. Shared memory: ``smem_per_sm`` (the largest carveout) over the program's bytes
    plus the 1 KiB the driver reserves per block. At most 64 warps and 32 blocks per SM."""
    per_warp = -(-max(1, n_regs) // 8) * 8 * 32
    warps = 4 * ((regs_per_sm // 4) // per_warp)
    by_regs = warps // num_warps
    by_smem = smem_per_sm // (shared_bytes + 1024)
    return max(1, min(by_regs, by_smem, 64 // num_warps, 32))


#: resident programs per SM of each compiled split-kernel variant (see decode_attention)
_RESIDENT_PROGRAMS: dict[tuple, int] = {}
#: the split plan's guess before a variant is compiled, and on the CPU interpreter (the
#: quantized splits' 1-warp programs at 200-240 registers: 8 per SM)
_RESIDENT_GUESS = 8


def _variant_resident_programs(key: tuple, device: torch.device, compile_variant) -> int:
    """:func:`resident_programs` of a compiled split-kernel variant, cached under ``key``;
    ``compile_variant()`` returns it compiled (Triton's ``warmup``: no launch). Falls back to
    the guess, with a warning, where a Triton build lacks the internals read here."""
    resident = _RESIDENT_PROGRAMS.get(key)
    if resident is not None:
        return resident
    try:
        kernel = compile_variant()
        kernel._init_handles()  # loads it: its register count is known from here
        props = _device_properties(device)
        resident = resident_programs(
            kernel.n_regs,
            kernel.metadata.shared,
            kernel.metadata.num_warps,
            props.regs_per_multiprocessor,
            props.shared_memory_per_multiprocessor,
        )
    except (AttributeError, TypeError) as e:
        warnings.warn(
            f"decode_attention: cannot read the compiled kernel's registers ({e}); "
            f"planning splits for {_RESIDENT_GUESS} programs per SM",
            stacklevel=3,
        )
        resident = _RESIDENT_GUESS
    _RESIDENT_PROGRAMS[key] = resident
    return resident


@dataclass(frozen=True)
class SplitGrid:
    """A launch's partial rows and programs per (request, KV head).

    rows: positions per partial row of the INT2, INT4 and full segments; k4: the INT4 rows
    one program runs (chunks, ``DecodeConfig.chunked_splits``; every other program runs
    one); s2 / s4 / s_total: the INT2, INT4 and all partial rows; p4 / programs: the INT4
    and all programs. An empty launch still has one (empty) row and program."""

    rows: tuple[int, int, int]
    k4: int
    s2: int
    s4: int
    s_total: int
    p4: int
    programs: int


def _split_grid(
    lens: tuple[int, ...], splits: tuple[int, ...], caps: tuple[int, ...], chunk4: bool
) -> SplitGrid:
    """A plan's positions per program of each segment ``lens`` (INT2, INT4, full) -> its
    :class:`SplitGrid`: a capped segment's rows are at most its cap; with ``chunk4`` an INT4
    program longer than its cap runs ``ceil(split / cap)`` rows of the cap."""
    rows = tuple(min(sl, c) if c else sl for sl, c in zip(splits, caps, strict=True))
    k4 = -(-splits[1] // caps[1]) if chunk4 and lens[1] and 0 < caps[1] < splits[1] else 1
    s2, s4, sf = (-(-m // sl) for m, sl in zip(lens, rows, strict=True))
    p4 = -(-s4 // k4)
    return SplitGrid(rows, k4, s2, s4, max(1, s2 + s4 + sf), p4, max(1, s2 + p4 + sf))


@dataclass(frozen=True)
class ChainLink:
    """One split launch's place in a decode call's launch chain (stream order: the Gluon
    INT2 split, the Gluon INT4 split, this module's split, then the merge).

    dependent: launched as a programmatic dependent of the previous split launch (sm_90+),
    so its programs start on the SMs the previous grid's tail leaves idle, and each waits
    at its end for that grid's completion and stores (``griddepcontrol.wait``): the grid
    completes after every grid before it, and the merge, which waits for the last one,
    sees all their partial rows. launch_dependents: its programs let the next launch start
    once all of them have started (``griddepcontrol.launch_dependents``)."""

    dependent: bool
    launch_dependents: bool


def launch_chain(
    pdl: bool, launched: tuple[bool, ...], splits: bool | Literal["last"] = False
) -> tuple[ChainLink, ...]:
    """Per split launch (``launched``: whether it runs, in stream order), its
    :class:`ChainLink`. With ``pdl`` the last launch that runs lets the merge, a
    programmatic dependent, start early; with ``splits`` True too every launch lets the next
    one start early and every launch after the first is a dependent; with ``splits`` "last"
    only the last launch that runs is a dependent (of the one that runs before it). Without
    ``pdl`` (no sm_90, the interpreter, ``DecodeConfig.pdl`` False) every launch is plain."""
    running = [i for i, on in enumerate(launched) if on]
    chained = set(running[1:])  # splits True: every launch after the first that runs
    if splits == "last":
        chained = set(running[-1:]) & chained
    elif splits is not True:
        chained = set()
    after = dict(zip(running[:-1], running[1:], strict=True))  # each launch's next one
    return tuple(
        ChainLink(
            pdl and i in chained,
            pdl and on and (i not in after or after[i] in chained),  # the last: the merge
        )
        for i, on in enumerate(launched)
    )


def _pdl_launch(link: ChainLink) -> dict:
    """A split launch's keyword arguments for its :class:`ChainLink`."""
    return {"launch_pdl": True} if link.dependent else {}


@functools.lru_cache(maxsize=1024)
def plan_wave_splits(
    heads: int,
    lens: tuple[int, ...],
    caps: tuple[int, ...],
    slots: int,
    min_len: int,
    overhead: int,
    max_waves: int = 16,
    chunked: tuple[bool, ...] | None = None,
) -> tuple[int, ...]:
    """Positions per split of each segment (multiples of 64) so that the launch's programs
    fill whole waves of the GPU's resident program slots.

    heads: (request, KV head) pairs; lens: the segments' lengths (positions, 0 = absent);
    caps: each segment's longest split (0: none); slots: programs the GPU runs at once (SMs
    x :func:`resident_programs`); min_len: the shortest split; overhead: a program's fixed
    cost (prologue, pipeline fill, partial store) in positions; chunked: per segment, whether
    its programs may run several chunks of its cap (``DecodeConfig.chunked_splits``: a
    partial output per chunk), so its split is a whole number of caps instead of at most one.
    Returns positions per program of each segment.

    The programs of one split length run about equally long, so a launch takes about
    ``waves x (longest split + overhead)``, where ``waves = ceil(programs / slots)``: a wave
    that is a little over full costs a whole extra wave. For w = 1, 2, ... waves this tries
    the shortest split that fits the programs into w waves (then the segment caps) and keeps
    the cheapest; ties go to fewer waves (fewer programs and partial outputs). H100
    (session 15): at B=32 N=4k, 4 splits of 1,024 (1,024 programs, one wave of 8 x 132) ran
    the INT4 split kernel 11% faster than 8 of 512 (2,048 programs: two waves, the second
    nearly full); 9 splits of 960 (1,152 programs: 96 in a second wave) 30% slower."""
    total = sum(lens)
    chunked = chunked or (False,) * len(caps)
    lo = -(-max(64, min_len) // 64) * 64
    best: tuple[int, tuple[int, ...]] | None = None
    for w in range(1, max_waves + 1):
        per_head = max(1, w * slots // max(1, heads))
        per_split = -(-max(1, total) // per_head)  # positions, before rounding to 64
        split = max(lo, -(-per_split // 64) * 64)
        ls = tuple(
            split if not c or split <= c else -(-split // c) * c if ch else c
            for c, ch in zip(caps, chunked, strict=True)
        )
        present = [(m, sl) for m, sl in zip(lens, ls, strict=True) if m]
        programs = heads * sum(-(-m // sl) for m, sl in present)
        waves = -(-programs // max(1, slots))
        cost = waves * (max((sl for _, sl in present), default=split) + overhead)
        if best is None or cost < best[0]:
            best = (cost, ls)
        if split == lo:
            break
    assert best is not None
    return best[1]


def plan_split_len(
    batch: int,
    num_kv_heads: int,
    total_len: int,
    device: torch.device,
    config: DecodeConfig,
    programs_per_sm: int | None = None,
) -> int:
    """Positions per split (a multiple of 64, hence of the INT2 page): enough splits to give
    about ``programs_per_sm`` (default ``config.programs_per_sm``) programs per SM, none
    shorter than ``min_split_len``. This is the plan with ``wave_splits`` off; the default
    plan is :func:`plan_wave_splits`'s."""
    return _split_len(
        batch,
        num_kv_heads,
        total_len,
        _num_sms(device),
        programs_per_sm or config.programs_per_sm,
        config.min_split_len,
    )


def validate_decode_inputs(
    pools: KVPools,
    slot_map: torch.Tensor,
    seq_lens: torch.Tensor,
    int2_lens: torch.Tensor | None = None,
    int4_lens: torch.Tensor | None = None,
    dead_id: int = DEAD,
) -> None:
    """Check the segment contract of the module docstring (device sync; for tests and
    debugging, not for the hot path). Raises ValueError on the first violation. Per-head
    inputs (``slot_map [B, Hkv, L]``, lengths ``[B, Hkv]``) are checked row by row."""
    if slot_map.dim() == 3:
        bh = slot_map.shape[0] * slot_map.shape[1]

        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            if x is None:
                return None
            return (x if x.dim() == 2 else x[:, None]).expand(slot_map.shape[:2]).reshape(bh)

        return validate_decode_inputs(
            pools,
            slot_map.reshape(bh, -1),
            rows(seq_lens),  # type: ignore[arg-type]
            rows(int2_lens),
            rows(int4_lens),
            dead_id,
        )
    b, length = slot_map.shape
    z = torch.zeros(b, dtype=torch.long, device=slot_map.device)
    n2 = int2_lens.long() if int2_lens is not None else z
    n4 = int4_lens.long() if int4_lens is not None else z
    n = seq_lens.long()
    if bool((n2 % INT2_PAGE != 0).any()):
        raise ValueError("int2_lens must be multiples of 32")
    if bool((n2 + n4 > n).any()) or bool((n > length).any()):
        raise ValueError("int2_lens + int4_lens <= seq_lens <= slot_map.shape[1] violated")
    s = slot_map.long()
    pos = torch.arange(length, device=s.device)[None, :]
    live = (s != dead_id) & (pos < n[:, None])
    in2 = pos < n2[:, None]
    in4 = (pos >= n2[:, None]) & (pos < (n2 + n4)[:, None])
    is2 = s >= pools.int2_base
    is4 = (s >= pools.int4_base) & ~is2
    if bool((live & (in2 != is2)).any()) or bool((live & (in4 != is4)).any()):
        raise ValueError("a live slot lies outside the segment of its precision")
    if bool((s[live] >= pools.num_unified_slots).any()) or bool((s[live] < 0).any()):
        raise ValueError("slot id out of range")
    page = torch.where(live & in2, (s - pools.int2_base) // INT2_PAGE, -1)
    blocks = page[:, : (length // INT2_PAGE) * INT2_PAGE].reshape(b, -1, INT2_PAGE)
    hi = blocks.max(-1).values
    lo = torch.where(blocks < 0, hi[..., None], blocks).min(-1).values
    if bool((hi != lo).any()):
        raise ValueError("an aligned 32-position INT2 block mixes pages")


def decode_attention(
    q: torch.Tensor,
    pools: KVPools,
    slot_map: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    int2_lens: torch.Tensor | None = None,
    int4_lens: torch.Tensor | None = None,
    head_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    dead_id: int = DEAD,
    max_lens: SegmentMaxLens | None = None,
    split_len: int | None = None,
    config: DecodeConfig | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Decode attention of one query token per request over mixed-precision, holed KV.

    q: [B, Hq, D] bf16/fp16 (Hq a multiple of Hkv). pools: the layer's :class:`KVPools`.
    slot_map: [B, L] int32 unified slot ids (segment contract in the module docstring), or
    [B, Hkv, L] per-KV-head slot maps (each head's own cells; the contract holds per head).
    seq_lens: [B] (or [B, Hkv] with per-head maps) int32 positions used. int2_lens /
    int4_lens: same shape as seq_lens, segment lengths (None = empty). head_mask:
    [B, Hkv, L] bool, True = attend (per-head eviction).
    sm_scale: defaults to 1/sqrt(D). dead_id: the DEAD slot id (default 0), masked by id.
    max_lens: host bounds of the segment lengths (default: L for each present segment).
    split_len: positions per split (multiple of 64; default from :func:`plan_split_len`).
    Returns [B, Hq, D] in q's dtype; a request with nothing live gets zeros.
    """
    b, hq, d = q.shape
    hkv = pools.num_kv_heads
    if d != pools.head_dim or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not match pools (Hkv={hkv}, D={pools.head_dim})")
    per_head = slot_map.dim() == 3
    if not (slot_map.dim() == 2 and slot_map.shape[0] == b) and not (
        per_head and tuple(slot_map.shape[:2]) == (b, hkv)
    ):
        raise ValueError(
            f"slot_map must be [B={b}, L] or [B, Hkv={hkv}, L], got {tuple(slot_map.shape)}"
        )
    if head_mask is not None and head_mask.shape != (b, hkv, slot_map.shape[-1]):
        raise ValueError(f"head_mask must be [B, Hkv, L], got {tuple(head_mask.shape)}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if resolve_backend(backend, q.device) == "torch":
        return decode_attention_ref(q, pools, slot_map, seq_lens, head_mask, scale, dead_id)
    if d not in (64, 128):
        raise ValueError(
            "the Triton decode kernel supports head_dim 64 or 128 (use backend='torch')"
        )

    cfg = config or _DEFAULT_CONFIG
    length = slot_map.shape[-1]
    has2 = int2_lens is not None and pools.int2 is not None
    has4 = int4_lens is not None and pools.int4 is not None
    if max_lens is None:
        max_lens = SegmentMaxLens(length if has2 else 0, length if has4 else 0, length)
    q = q if q.stride(-1) == 1 else q.contiguous()
    hm = None  # (the uint8 head mask, contiguous along positions)
    if head_mask is not None:
        hm = head_mask.to(torch.uint8) if head_mask.dtype == torch.bool else head_mask
        if hm.stride(-1) != 1:
            hm = hm.contiguous()
    n2 = int2_lens if has2 else seq_lens
    n4 = int4_lens if has4 else seq_lens
    if seq_lens.dim() == 2 or n2.dim() == 2 or n4.dim() == 2:
        seq_lens, n2, n4 = (
            (t if t.dim() == 2 else t[:, None]).expand(b, hkv).contiguous()
            for t in (seq_lens, n2, n4)
        )
    else:  # (unrolled: each generator here cost ~0.5 µs of every call)
        seq_lens, n2, n4 = seq_lens.contiguous(), n2.contiguous(), n4.contiguous()
    interpreting = triton_interpreting()
    # everything the plan reads that is not a tensor's contents, and everything Triton
    # specializes its launches on (the tensors' shapes, strides, dtypes and 16-byte
    # alignment; the pools' in their layout key): equal keys, equal launches (the plan's
    # own allocations come from torch's allocator, aligned)
    key = (
        pools.layout_key(),
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        q.data_ptr() & 15,
        slot_map.shape,
        slot_map.stride(),
        slot_map.dtype,
        slot_map.data_ptr() & 15,
        seq_lens.dtype,
        n2.dtype,
        n4.dtype,
        seq_lens.dim(),
        seq_lens.data_ptr() & 15,
        n2.data_ptr() & 15,
        n4.data_ptr() & 15,
        None if hm is None else (hm.dtype, hm.stride(), hm.data_ptr() & 15),
        has2,
        has4,
        scale,
        dead_id,
        max_lens.int2,
        max_lens.int4,
        max_lens.full,
        split_len,
        id(cfg),  # (the plan holds cfg: no other config gets its id while the plan is kept)
        interpreting,
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = DecodePlan(
            cfg, q, pools, slot_map, seq_lens, n2, n4, hm, has2, has4, scale, dead_id,
            max_lens, split_len, interpreting,
        )  # fmt: skip
        if len(_PLANS) >= _MAX_PLANS:
            with contextlib.suppress(StopIteration, RuntimeError):  # (another thread's)
                _PLANS.pop(next(iter(_PLANS)), None)  # the oldest
        _PLANS[key] = plan
    return plan.run(q, pools, slot_map, seq_lens, n2, n4, hm)


#: decode plans by their call's key (see decode_attention), oldest first
_PLANS: dict[tuple, DecodePlan] = {}
_MAX_PLANS = 512


def held_decode_plans() -> list[DecodePlan]:
    """Every remembered :class:`DecodePlan`: a CUDA graph that captured their launches holds
    these (their scratch buffers must outlive it, even once the oldest leave the cache)."""
    return list(_PLANS.values())


def clear_decode_plans() -> None:
    """Forget every remembered :class:`DecodePlan` (e.g. after changing what planning reads
    from outside its inputs, as tests that stand in for a GPU do)."""
    _PLANS.clear()


class DecodePlan:
    """What :func:`decode_attention` decides for a call before it launches anything: which
    kernels run each segment's splits, their constexprs and grids, the partial rows, the
    launch chain, the merge's tiles. It depends on the tensors' shapes, strides, dtypes and
    alignment and on the scalars, never on their contents, so it is made once per distinct
    call (per decode shape: every layer and step of an engine's decode reuses it) and kept
    by :func:`decode_attention`; each launch site is a :class:`~.direct_launch.DirectLaunch`
    (``DecodeConfig.direct_launch``). Made with the call's tensors, which it keeps none of
    (a variant's residency is measured by compiling it with them, once per variant)."""

    def __init__(
        self,
        cfg: DecodeConfig,
        q: torch.Tensor,
        pools: KVPools,
        slot_map: torch.Tensor,
        seq_lens: torch.Tensor,
        n2: torch.Tensor,
        n4: torch.Tensor,
        hm: torch.Tensor | None,
        has2: bool,
        has4: bool,
        scale: float,
        dead_id: int,
        max_lens: SegmentMaxLens,
        split_len: int | None,
        interpreting: bool,
    ) -> None:
        self.config = cfg
        b, hq, d = q.shape
        hkv = pools.num_kv_heads
        self.hkv = hkv
        per_head = slot_map.dim() == 3
        m2 = max_lens.int2 if has2 else 0
        m4 = max_lens.int4 if has4 else 0
        mf = max_lens.full
        g = hq // hkv
        g_pow2 = 1 << (g - 1).bit_length()  # triton.next_power_of_2 is a constexpr_function (slow)
        block_hq = max(cfg.min_block_hq, g_pow2)
        stacked = cfg.int4_stacked
        v_fold = cfg.int4_v_fold
        if stacked is None:  # stacked rows fit one 16-row MMA tile; else fp16-dequantized values
            stacked = block_hq * (d // 32) <= 16
            v_fold = v_fold and stacked
        # the scale-folded splits' sums cancel: keep them short
        cap = cfg.folded_split_cap(m2 + m4 + mf)
        centred = cfg.int4_v_centred and stacked  # (__post_init__: never with subnormal codes)
        cap2 = cap if cfg.int2_fold else 0
        cap4 = cap if not cfg.int4_legacy and (stacked or v_fold) and not centred else 0

        f, p4, p2 = pools.full, pools.int4, pools.int2
        if f.k.stride() != f.v.stride() or f.k.stride(-1) != 1:
            raise ValueError("full pool k and v need equal strides and a contiguous last dim")
        self.has2, self.has4 = has2, has4
        self.has_kcs = has4 and p4.k_channel is not None
        # where the INT4 pool's (slot, head) rows lie (slot- or head-major; checked here)
        rows4 = p4.row_map() if has4 else Int4RowMap(hkv, 1, d // 32)
        self.rows4 = rows4
        sstride, interleaved = rows4.scale_stride, rows4.interleaved
        q2 = (p2.k, p2.v, p2.k_scale, p2.k_zero, p2.v_scale, p2.v_zero) if has2 else (slot_map,)
        if not all(t.is_contiguous() for t in q2):
            raise ValueError("quantized pools must be contiguous (INT4: see Int4Pool.row_map)")
        self.stride_lb, self.stride_lh = (hkv, 1) if seq_lens.dim() == 2 else (1, 0)
        self.qk_scale = scale * _LOG2E
        self.dead_id = dead_id
        self.int4_base, self.int2_base = pools.int4_base, pools.int2_base

        # the INT2 splits on the Gluon kernel (its own launch), the other segments' here
        gluon2 = m2 > 0 and _use_gluon_int2(cfg, q.device, d, g, slot_map.dtype, interpreting)
        t2 = m2 > 0 and not gluon2  # INT2 splits in this module's kernel
        # the INT4 splits likewise; this module's launch then runs a contiguous run of
        # programs (the full segment's), so not beside INT2 splits of its own
        gluon4 = m4 > 0 and _use_gluon_int4(
            cfg, q.device, d, g, slot_map.dtype, interpreting, t2, p4, sstride, interleaved
        )
        t4 = m4 > 0 and not gluon4  # INT4 splits in this module's kernel
        if gluon4:  # its blocks' dots start from zero and are summed rounding to nearest
            cap4 = cap * cfg.int4_gluon_cap_factor
        imma = stacked if cfg.int4_imma is None else cfg.int4_imma  # int8 key dots where stacked
        # the stacked INT4 split may run several capped chunks (a partial row each), in
        # launches without INT2 segments (H100, session 16: beside INT2 segments 0.5-2.5%
        # slower; the INT2 split chunked too was -6% to +4% alone and 4-10% slower in mixed
        # launches: not kept)
        chunk4 = (
            cfg.chunked_splits
            and cap4 > 0
            and m2 == 0
            and (stacked or imma)
            and not cfg.int4_legacy
            and not gluon4
        )
        scale_tile = cfg.int4_scale_tile and stacked and interleaved and not centred
        regs = None if interpreting else cfg.max_registers
        # the merge as a programmatic dependent launch where the GPU has it (sm_90+); by
        # default only where it is narrow (few rows: the early launch paid at B=1, lost at
        # B>=16)
        narrow = b * hq < _num_sms(q.device)
        # this module's split runs unless the Gluon splits take every segment there is (then
        # the plan below gives it no program)
        runs_here = mf > 0 or t2 or t4 or not (gluon2 or gluon4)
        chain = cfg.pdl_splits
        if chain is None:  # a short full window behind the Gluon splits: chained (see DecodeConfig)
            window = runs_here and not (t2 or t4) and (gluon2 or gluon4) and mf < m2 + m4
            chain = "last" if window else False
        wanted = cfg.pdl is True or (cfg.pdl is None and (narrow or bool(chain)))
        pdl = wanted and not interpreting and _pdl_capable(q.device)
        # both Gluon splits in one launch (the INT2 launch's place in the chain)
        fused = gluon2 and gluon4 and cfg.mixed_gluon_fused
        self.gluon2, self.gluon4, self.fused = gluon2, gluon4, fused
        # the launches' programmatic dependencies
        link2, link4, link = launch_chain(pdl, (gluon2, gluon4 and not fused, runs_here), chain)
        # this module's split's constexprs and launch options, where it runs (its plan and
        # its launch read them; where the Gluon splits take every segment, ~3 µs of host
        # time saved)
        consts = (
            {}
            if not runs_here
            else dict(
                G=g,
                BLOCK_H=max(16, g_pow2),
                BLOCK_HQ=block_hq,
                D=d,
                BN_FULL=cfg.block_n_full,
                BN_INT4=cfg.block_n_int4,
                HAS_FULL=mf > 0,
                HAS_INT4=t4,
                HAS_INT2=t2,
                HAS_HEAD_MASK=hm is not None,
                HAS_KCS=self.has_kcs,
                IEEE_F32=interpreting,
                USE_ASM=not interpreting,
                PREFETCH=cfg.prefetch,
                INT2_PIPELINED=cfg.int2_pipelined,
                INT2_LAZY_RESCALE=cfg.int2_lazy(m4 > 0),
                V_FOLD=v_fold,
                INT4_LEGACY=cfg.int4_legacy,
                STACKED=stacked or imma,
                KEY_IMMA=imma,
                LAZY_RESCALE=cfg.int4_lazy_rescale,
                V_SUBNORMAL=cfg.int4_v_subnormal,
                V_DOTS8=cfg.int4_v_dots8,
                OFFS32=cfg.int4_offsets32 and has4 and p4.k.numel() < 2**31,
                INT2_FOLD=cfg.int2_fold,
                INT2_V_WORDS=cfg.int2_v_words,
                INT4_LIVE_FROM_SCALES=cfg.int4_live_from_scales and stacked,
                HEADS_FASTEST=cfg.heads_fastest,
                V_CENTRED=centred,
                INT4_V_SCALES_BY_DOT=cfg.int4_v_scales_by_dot and stacked,
                INT4_SCALE_STRIDE=sstride,
                INT4_SCALE_TILE=scale_tile,
                INT4_CHUNKS=False,  # set below where the plan gives INT4 programs several chunks
                LAUNCH_DEPENDENTS=link.launch_dependents,
                INT2_ELSEWHERE=gluon2,
                INT4_ELSEWHERE=gluon4,
                WAIT_PRIOR=link.dependent,
                num_warps=cfg.warps(t4, t2),
                num_stages=cfg.stages(t4, t2),
                **({"maxnreg": regs} if regs else {}),
                **_pdl_launch(link),
            )
        )
        # the Gluon splits' softmax: exact max (p <= 1) unless lazy is asked for (H200:
        # within noise of lazy, and the dominant token's p * vs is not rounded)
        lazy2 = cfg.int2_lazy_rescale is True
        has_hm = hm is not None
        fconsts = {}
        if fused:
            fconsts = mixed_split_gluon_consts(
                g,
                d,
                sstride,
                interleaved,
                has_hm,
                self.has_kcs,
                regs,
                lazy2,
                cfg.int2_gluon_stages,
                cfg.int4_stages(mixed=True),
                link2.launch_dependents,
                link2.dependent,
            ) | _pdl_launch(link2)
        gconsts = {}
        if gluon2 and not fused:
            gconsts = int2_split_gluon_consts(
                g,
                d,
                has_hm,
                regs,
                lazy2,
                cfg.int2_gluon_stages,
                link2.launch_dependents,
                link2.dependent,
            ) | _pdl_launch(link2)
        g4consts = {}
        if gluon4 and not fused:
            g4consts = int4_split_gluon_consts(
                g,
                d,
                sstride,
                interleaved,
                has2,
                has_hm,
                self.has_kcs,
                regs,
                cfg.int4_stages(adjacent_slots=rows4.slot_rows <= 1),
                link4.launch_dependents,
                link4.dependent,
            ) | _pdl_launch(link4)

        call = (q, pools, slot_map, seq_lens, n2, n4, hm)  # (for the residency probes only)
        lens = (m2, m4, mf)
        caps = (cap2, cap4, 0)
        if split_len is not None:
            if split_len % 64:
                raise ValueError("split_len must be a multiple of 64")
            splits = (split_len,) * 3
        elif cfg.wave_splits:

            def wave_plan(resident: int, seg: tuple[int, ...]) -> tuple[int, ...]:
                slots = _num_sms(q.device) * resident
                return plan_wave_splits(
                    b * hkv,
                    seg,
                    caps,
                    slots,
                    cfg.min_split_len,
                    cfg.program_overhead_len,
                    chunked=(False, chunk4, False),
                )

            # this module's kernel: every segment, or those past the ones Gluon runs
            tri = (0 if gluon2 else m2, 0 if gluon4 else m4, mf)
            splits = (cfg.min_split_len,) * 3  # (a segment that is absent: no program)
            if any(tri):
                key = (q.device, q.dtype, f.k.dtype, per_head, *consts.values())
                resident = cfg.resident_programs or _RESIDENT_PROGRAMS.get(key)
                splits = wave_plan(resident or _RESIDENT_GUESS, tri)
                if resident is None and not interpreting:
                    # compile the variant with the guessed plan's arguments (no launch), so
                    # the launch below finds it compiled when the guess holds
                    scratch = torch.empty(1, dtype=torch.float32, device=q.device)
                    self.grid = _split_grid(lens, splits, caps, chunk4)
                    args = self.split_args(*call, scratch, scratch)
                    resident = _variant_resident_programs(
                        key,
                        q.device,
                        lambda: _decode_split_kernel.warmup(*args, grid=(1,), **consts),
                    )
                    splits = wave_plan(resident, tri)

            def gluon_resident(tag: str, kernel, args_of, kconsts: dict) -> int:
                """Programs per SM of a Gluon split (measured once per variant)."""
                key = (q.device, q.dtype, tag, per_head, *kconsts.values())
                resident = cfg.resident_programs or _RESIDENT_PROGRAMS.get(key)
                if resident is None:
                    scratch = torch.empty(1, dtype=torch.float32, device=q.device)
                    self.grid = _split_grid(lens, (cfg.min_split_len,) * 3, caps, False)
                    args = args_of(*call, scratch, scratch)
                    resident = _variant_resident_programs(
                        key, q.device, lambda: kernel.warmup(*args, grid=(1,), **kconsts)
                    )
                return resident

            # the INT2 / INT4 splits planned for their Gluon kernels' own residency (one
            # launch: together, for its residency)
            if fused:
                resf = gluon_resident(
                    "gluon-mixed", mixed_split_gluon_kernel, self.fused_args, fconsts
                )
                # an INT4 position costs mixed_int4_cost INT2 positions: planned in INT2
                # units, the INT4 split that many times shorter, so the grid's programs end
                # together
                w = cfg.mixed_int4_cost
                l2, l4 = wave_plan(resf, (m2, math.ceil(m4 * w), 0))[:2]
                splits = (l2, max(64, int(l4 / w) // 64 * 64), splits[2])
            elif gluon2:
                res2 = gluon_resident("gluon-int2", int2_split_gluon_kernel, self.gluon2_args, gconsts)  # fmt: skip
                splits = (wave_plan(res2, (m2, 0, 0))[0], *splits[1:])
            if gluon4 and not fused:
                res4 = gluon_resident("gluon-int4", int4_split_gluon_kernel, self.gluon4_args, g4consts)  # fmt: skip
                l4 = wave_plan(res4, (0, m4, 0))[1]
                few = cfg.int4_gluon_resident_cap
                if 0 < few < res4:  # fewer, longer short programs where they fill one wave
                    l4_few = wave_plan(few, (0, m4, 0))[1]
                    one_wave = b * hkv * -(-m4 // l4_few) <= _num_sms(q.device) * few
                    if one_wave and l4_few <= cfg.int4_gluon_resident_cap_split:
                        l4 = l4_few
                splits = (splits[0], l4, splits[2])
        else:
            total, sms = m2 + m4 + mf, _num_sms(q.device)
            splits = tuple(
                _split_len(b, hkv, total, sms, pps, cfg.min_split_len)
                for pps in (cfg.programs_per_sm_int2, cfg.programs_per_sm_int4, cfg.programs_per_sm)
            )
        # the folded caps: rows of at most the cap (chunked: several rows to a program)
        grid = self.grid = _split_grid(lens, splits, caps, chunk4)
        if grid.k4 > 1:  # its own variant: the chunk bookkeeping would cost launches that do
            # not (planned with the plain variant's residency: 214 vs 215 registers, 8 per
            # SM alike)
            consts = {**consts, "INT4_CHUNKS": True}
        # this module's programs: those past the splits the Gluon kernels ran (INT2, INT4)
        self.s_first = (grid.s2 if gluon2 else 0) + (grid.p4 if gluon4 else 0)
        programs = grid.programs - self.s_first
        self.runs_here = programs > 0
        self.tri_grid = (hkv, programs, b) if cfg.heads_fastest else (programs, hkv, b)
        # few (request, query head) rows: more, narrower merge programs (a split of D)
        block_d = cfg.merge_block_d
        if block_d is None:
            block_d = 32 if narrow else d
        block_d = min(block_d, d)
        self.merge_grid = (b * hq, d // block_d, 1)
        mconsts = dict(
            D=d,
            # (a step's partial tile at most 16,384 fp32: 128 per thread of the 4 warps)
            BLOCK_S=min(
                cfg.merge_block_s, 16384 // block_d, max(16, 1 << (grid.s_total - 1).bit_length())
            ),
            BLOCK_D=block_d,
            GDC_WAIT=pdl,
            num_warps=4,
            **({"launch_pdl": True} if pdl else {}),
        )
        # (the plan's key covers every launch argument's specialization: see decode_attention)
        direct = cfg.direct_launch and not interpreting
        self.fused_launch = DirectLaunch(mixed_split_gluon_kernel, fconsts, direct, True)
        self.gluon2_launch = DirectLaunch(int2_split_gluon_kernel, gconsts, direct, True)
        self.gluon4_launch = DirectLaunch(int4_split_gluon_kernel, g4consts, direct, True)
        self.tri_launch = DirectLaunch(_decode_split_kernel, consts, direct, True)
        self.merge_launch = DirectLaunch(_merge_splits_kernel, mconsts, direct, True)

    def run(
        self,
        q: torch.Tensor,
        pools: KVPools,
        slot_map: torch.Tensor,
        seq_lens: torch.Tensor,
        n2: torch.Tensor,
        n4: torch.Tensor,
        hm: torch.Tensor | None,
    ) -> torch.Tensor:
        """Launch the plan on a call's tensors (those of :func:`decode_attention` after its
        checks: ``q`` contiguous along D, lengths contiguous, the uint8 head mask or None);
        returns [B, Hq, D] in q's dtype."""
        b, hq, d = q.shape
        grid = self.grid
        s_total = grid.s_total
        dev = q.device
        part_o = torch.empty(b, hq, s_total, d, dtype=torch.float32, device=dev)
        part_lse = torch.empty(b, hq, s_total, dtype=torch.float32, device=dev)
        out = torch.empty(b, hq, d, dtype=q.dtype, device=dev)
        call = (q, pools, slot_map, seq_lens, n2, n4, hm, part_o, part_lse)
        hkv = self.hkv
        # (each kernel as the module holds it now: a test's or benchmark's stand-in included)
        if self.fused:
            launch = (hkv, grid.s2 + grid.s4, b)
            self.fused_launch(mixed_split_gluon_kernel, launch, self.fused_args(*call))
        elif self.gluon2:
            self.gluon2_launch(int2_split_gluon_kernel, (hkv, grid.s2, b), self.gluon2_args(*call))  # fmt: skip
        if self.gluon4 and not self.fused:
            self.gluon4_launch(int4_split_gluon_kernel, (hkv, grid.s4, b), self.gluon4_args(*call))  # fmt: skip
        if self.runs_here:
            self.tri_launch(
                _decode_split_kernel, self.tri_grid, self.split_args(*call, self.s_first)
            )
        self.merge_launch(
            _merge_splits_kernel,
            self.merge_grid,
            (part_o, part_lse, out, out.stride(0), out.stride(1), hq, s_total),
        )
        return out

    def split_args(
        self, q, pools, slot_map, seq_lens, n2, n4, hm, part_o, part_lse, s_first: int = 0
    ) -> tuple:
        """This module's split kernel's positional arguments."""
        f, p4, p2 = pools.full, pools.int4, pools.int2
        dummy = slot_map
        q4 = (
            (p4.k, p4.v, p4.k_scale, p4.k_zero, p4.v_scale, p4.v_zero)
            if self.has4
            else (dummy,) * 6
        )
        q2 = (
            (p2.k, p2.v, p2.k_scale, p2.k_zero, p2.v_scale, p2.v_zero)
            if self.has2
            else (dummy,) * 6
        )
        grid = self.grid
        return (
            *query_slot_args(q, slot_map),
            seq_lens,
            n2,
            n4,
            self.stride_lb,
            self.stride_lh,
            *head_mask_args(hm, dummy),
            f.k,
            f.v,
            f.k.stride(0),
            f.k.stride(1),
            *q4,
            p4.k_channel if self.has_kcs else dummy,
            self.rows4.slot_rows,
            self.rows4.head_rows,
            *q2,
            part_o,
            part_lse,
            self.qk_scale,
            self.dead_id,
            self.int4_base,
            self.int2_base,
            self.hkv,
            *grid.rows,
            grid.s2,
            grid.s4,
            grid.s_total,
            grid.p4,
            grid.k4,
            s_first,
        )

    def gluon2_args(self, q, pools, slot_map, seq_lens, n2, n4, hm, part_o, part_lse) -> tuple:
        """The Gluon INT2 split's positional arguments."""
        return int2_split_gluon_args(
            q,
            slot_map,
            n2,
            self.stride_lb,
            self.stride_lh,
            hm,
            pools.int2,
            part_o,
            part_lse,
            self.qk_scale,
            self.dead_id,
            self.int2_base,
            self.grid.rows[0],
            self.grid.s_total,
        )

    def gluon4_args(self, q, pools, slot_map, seq_lens, n2, n4, hm, part_o, part_lse) -> tuple:
        """The Gluon INT4 split's positional arguments."""
        return int4_split_gluon_args(
            q,
            slot_map,
            n2,
            n4,
            self.stride_lb,
            self.stride_lh,
            hm,
            pools.int4,
            part_o,
            part_lse,
            self.qk_scale,
            self.dead_id,
            self.int4_base,
            self.grid.rows[1],
            self.grid.s_total,
            self.grid.s2,
        )

    def fused_args(self, q, pools, slot_map, seq_lens, n2, n4, hm, part_o, part_lse) -> tuple:
        """The one mixed Gluon launch's positional arguments."""
        return mixed_split_gluon_args(
            q,
            slot_map,
            n2,
            n4,
            self.stride_lb,
            self.stride_lh,
            hm,
            pools.int2,
            pools.int4,
            part_o,
            part_lse,
            self.qk_scale,
            self.dead_id,
            self.int2_base,
            self.int4_base,
            self.grid.rows[0],
            self.grid.rows[1],
            self.grid.s_total,
            self.grid.s2,
        )
