"""The Gluon INT4 decode split (kernels/decode_int4_gluon.py): when decode_attention uses it,
and, on a GPU, its output against the float32 torch reference and against the Triton INT4
split on the same quantized pools. Triton's CPU interpreter does not run Gluon kernels: on
CPU only the dispatch is tested (the Triton split it falls back to is tested in
test_decode_attention.py)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from gluon_gpu import (
    CUDA,
    GLUON_GPU,
    assert_matches_reference_and_triton,
    assert_same_bits,
    case_batch,
    needs_gluon_gpu,
    reference_cases,
    rel_err,
    same_bits_cases,
)
from mixed_batch import build_mixed_batch, int4_head_major, separate_int4_scales

from agentkv.kernels import DecodeConfig, decode_attention, decode_attention_ref

dattn = importlib.import_module("agentkv.kernels.decode_attention")

#: the Gluon INT4 split forced, and the Triton INT4 split (the Gluon INT2 split on in both,
#: which a launch with INT2 and Gluon INT4 splits needs)
ON = DecodeConfig(int4_gluon=True, int2_gluon=True)
OFF = DecodeConfig(int4_gluon=False, int2_gluon=True)


def test_dispatch_off_where_it_cannot_run() -> None:
    """None: off on CPU tensors, under the interpreter, for head_dim 64, GQA groups above 8,
    int64 slot maps, the legacy INT4 split and beside INT2 splits on the Triton kernel; True
    where it cannot run: a ValueError that says what it needs; False: always off."""
    use = dattn._use_gluon_int4
    cpu = torch.device("cpu")
    auto, on, off = DecodeConfig(), DecodeConfig(int4_gluon=True), DecodeConfig(int4_gluon=False)
    assert not use(auto, cpu, 128, 4, torch.int32, interpreting=False)
    assert not use(on, cpu, 128, 4, torch.int32, interpreting=True)  # the interpreter: Triton
    assert not use(off, cpu, 128, 4, torch.int32, interpreting=False)
    with pytest.raises(ValueError, match="compute capability"):
        use(on, cpu, 128, 4, torch.int32, interpreting=False)
    if GLUON_GPU:
        for d, g, dt, legacy, int2_tri, what in [
            (64, 4, torch.int32, False, False, "head_dim 128"),
            (128, 16, torch.int32, False, False, "group <= 8"),
            (128, 4, torch.int64, False, False, "int32 slot map"),
            (128, 4, torch.int32, True, False, "int4_legacy"),
            (128, 4, torch.int32, False, True, "INT2 splits on the Gluon kernel"),
        ]:
            cfg = DecodeConfig(int4_legacy=legacy)
            assert not use(cfg, CUDA, d, g, dt, False, int2_tri)
            with pytest.raises(ValueError, match=what):
                use(DecodeConfig(int4_gluon=True, int4_legacy=legacy), CUDA, d, g, dt, False, int2_tri)  # fmt: skip
        expect = torch.cuda.get_device_capability(CUDA) >= (9, 0)
        assert use(auto, CUDA, 128, 4, torch.int32, interpreting=False) is expect


def test_cap_factor_is_checked() -> None:
    with pytest.raises(ValueError, match="int4_gluon_cap_factor"):
        DecodeConfig(int4_gluon_cap_factor=-1)
    assert DecodeConfig().int4_gluon_cap_factor * DecodeConfig().max_split_len_folded == 4096


@pytest.mark.parametrize("knob", ["int4_gluon_stages", "int2_gluon_stages"])
def test_gluon_stages_are_checked(knob) -> None:
    """The Gluon splits' pipelines are written for 2 or 3 stages: anything else is refused
    when the config is made, not when a launch compiles."""
    for bad in (1, 4):
        with pytest.raises(ValueError, match=knob):
            DecodeConfig(**{knob: bad})
    assert (DecodeConfig().int4_gluon_stages, DecodeConfig().int2_gluon_stages) == (None, 2)


def test_int4_stages_follow_the_launch_and_the_pool() -> None:
    """``int4_gluon_stages`` None: two stages for the INT4-only launch over a head-major pool
    (H200, sessions 28 and 36: -1 to -7% on the store's rows, wide or narrow), three in the
    mixed launch and over slot-major pools (session 36: 2 stages on their scattered rows,
    B=8 N=32k, 1.84x SDPA instead of 2.18x); a number is kept."""
    auto = DecodeConfig()
    assert auto.int4_stages() == 2
    assert auto.int4_stages(mixed=True) == 3
    assert auto.int4_stages(adjacent_slots=False) == 3
    assert DecodeConfig(int4_gluon_stages=3).int4_stages() == 3
    assert DecodeConfig(int4_gluon_stages=2).int4_stages(mixed=True) == 2


@needs_gluon_gpu
def test_dispatch_by_pool_layout() -> None:
    """None: on for the pool's interleaved scales, with or without a per-channel key scale;
    off for four separate scale tensors (slower there than the Triton split), where True
    runs it; off for a pool tensor off a 16-byte boundary, where True raises a ValueError
    naming the alignment."""
    use = dattn._use_gluon_int4
    auto, on = DecodeConfig(), DecodeConfig(int4_gluon=True)
    expect = torch.cuda.get_device_capability(CUDA) >= (9, 0)
    args = (CUDA, 128, 4, torch.int32, False, False)
    p4 = build_mixed_batch([(0, 64, 0)], hq=8, hkv=2, d=128, seed=1).pools.int4
    assert p4.scales_interleaved
    assert use(auto, *args, p4, p4.scale_row_stride(), True) is expect
    p4.k_channel = torch.ones(2, 128, device=CUDA)
    assert use(auto, *args, p4, p4.scale_row_stride(), True) is expect
    pools = build_mixed_batch([(0, 64, 0)], hq=8, hkv=2, d=128, seed=1).pools
    separate_int4_scales(pools)
    p4 = pools.int4
    assert not use(auto, *args, p4, p4.scale_row_stride(), False)
    assert use(on, *args, p4, p4.scale_row_stride(), False)
    # a zeros tensor 4 bytes past a 16-byte boundary
    buf = torch.empty(p4.k_zero.numel() + 2, dtype=p4.k_zero.dtype, device=CUDA)
    p4.k_zero = buf[2:].view_as(p4.k_zero)
    assert not use(auto, *args, p4, p4.scale_row_stride(), False)
    with pytest.raises(ValueError, match="16-byte"):
        use(on, *args, p4, p4.scale_row_stride(), False)


GLUON_CASES = [
    # id, then gluon_gpu.CASE_FIELDS
    ("int4_gqa4", [(0, 300, 0), (0, 170, 0)], 8, 2, 0.0, "random", 0.0, 0),
    ("int4_gqa8_dead", [(0, 230, 0), (0, 400, 0), (0, 7, 0)], 16, 2, 0.4, "random", 0.0, 5),
    ("int4_gqa1_headmask", [(0, 190, 0), (0, 97, 0)], 2, 2, 0.2, "random", 0.3, 3),
    ("int4_gqa2_short", [(0, 1, 0), (0, 0, 0), (0, 333, 0)], 4, 2, 0.1, "run", 0.0, 0),
    ("int4_gqa3_run_dead", [(0, 500, 0)], 6, 2, 0.5, "run", 0.0, 0),
    ("int4_full_gqa4", [(0, 140, 9), (0, 33, 17), (0, 65, 0)], 8, 2, 0.3, "random", 0.2, 3),
    ("mixed_gqa4", [(5, 40, 9), (3, 0, 17), (2, 65, 0)], 8, 2, 0.3, "random", 0.2, 3),
    ("mixed_gqa6_run_dead", [(4, 93, 20)], 12, 2, 0.5, "run", 0.0, 0),
]


@needs_gluon_gpu
@reference_cases(GLUON_CASES)
def test_gluon_split_matches_reference_and_triton_split(
    lens, hq, hkv, dead, pattern, hm, pad, dtype, split_len
) -> None:
    """INT4-only launches (host bounds saying so: the Gluon kernel alone), with full segments
    (the Triton kernel's full splits in a second launch) and with INT2 ones (three launches),
    DEAD cells and runs, head masks, shuffled slots, empty and one-token requests, GQA groups
    1-8: within 1e-3 (fp16; bf16: its rounding) of the float32 reference and of the Triton
    INT4 split."""
    case = (lens, hq, hkv, dead, pattern, hm, pad)
    assert_matches_reference_and_triton(case, dtype, split_len, hq * 11 + len(lens), ON, OFF, 1)


@needs_gluon_gpu
@same_bits_cases(GLUON_CASES)
def test_gluon_split_two_stages_give_the_same_bits(
    lens, hq, hkv, dead, pattern, hm, pad, split_len
) -> None:
    """The two-stage pipeline (one block in flight, ``int4_gluon_stages=2``) sums the same
    blocks in the same order as the three-stage one: the same output bits."""
    case = (lens, hq, hkv, dead, pattern, hm, pad)
    two = dataclasses.replace(ON, int4_gluon_stages=2)
    assert_same_bits(case, split_len, hq * 13 + len(lens), ON, two)


@needs_gluon_gpu
@same_bits_cases(GLUON_CASES)
@pytest.mark.parametrize("splits", [False, True, "last"], ids=["merge", "splits", "last"])
def test_launch_chain_gives_the_bits_of_plain_launches(
    lens, hq, hkv, dead, pattern, hm, pad, split_len, splits
) -> None:
    """On sm_90+ (``pdl``; by default there in narrow launches) the merge is a programmatic
    dependent of the last split launch; with ``pdl_splits`` the Gluon INT2 split, the Gluon
    INT4 split and the Triton split are chained too: the same bits as plain launches one
    after the other."""
    case = (lens, hq, hkv, dead, pattern, hm, pad)
    chained = dataclasses.replace(ON, pdl=True, pdl_splits=splits)
    plain = dataclasses.replace(ON, pdl=False)
    assert_same_bits(case, split_len, hq * 17 + len(lens), chained, plain)


MIXED_CASES = [c for c in GLUON_CASES if any(r[0] and r[1] for r in c[1])]


@needs_gluon_gpu
@same_bits_cases(MIXED_CASES)
@pytest.mark.parametrize("chain", [False, True], ids=["plain", "pdl"])
def test_one_mixed_launch_gives_the_bits_of_two(
    lens, hq, hkv, dead, pattern, hm, pad, split_len, chain
) -> None:
    """``mixed_gluon_fused``: the INT2 and INT4 splits in one grid (decode_mixed_gluon.py)
    run the two kernels' code on the same splits: the bits of the two launches, plain and
    with the merge (and a full segment's split) as programmatic dependents."""
    case = (lens, hq, hkv, dead, pattern, hm, pad)
    one = dataclasses.replace(ON, mixed_gluon_fused=True, pdl=chain, pdl_splits=None)
    two = dataclasses.replace(ON, mixed_gluon_fused=False, pdl=False, pdl_splits=False)
    assert_same_bits(case, split_len, hq * 19 + len(lens), one, two)


@needs_gluon_gpu
def test_one_mixed_launch_per_head_slot_maps() -> None:
    """Per-(request, KV head) slot maps and segment lengths (the engine's layout) on the one
    mixed launch: head 1 lost INT2 and INT4 cells (DEAD); the bits of the two launches on
    the same splits, within 1e-3 of the reference."""
    mb = build_mixed_batch([(4, 100, 0), (3, 60, 0)], hq=8, hkv=2, d=128, dead_fraction=0.2, seed=9)  # fmt: skip
    b, hkv = 2, 2
    sm = mb.slot_map[:, None, :].repeat(1, hkv, 1)
    sm[:, 1, 40:90] = 0  # head 1: the end of its INT2 pages and the start of its INT4 cells
    n2, n4 = (t[:, None].expand(b, hkv).contiguous() for t in (mb.int2_lens, mb.int4_lens))
    seq = n2 + n4
    out = {}
    for fused in (True, False):
        cfg = dataclasses.replace(ON, mixed_gluon_fused=fused)
        out[fused] = decode_attention(
            mb.q, mb.pools, sm, seq, int2_lens=n2, int4_lens=n4, split_len=64, config=cfg
        )
    ref = decode_attention_ref(mb.q, mb.pools, sm, seq)
    assert torch.equal(out[True], out[False]), rel_err(out[True], out[False])
    assert rel_err(out[True], ref) < 1e-3, rel_err(out[True], ref)


@needs_gluon_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_mixed_launch_plans_its_own_splits(dtype) -> None:
    """With the wave plan (no fixed split length) one mixed launch splits both segments for
    its own grid: within 1e-3 (fp16; bf16 8e-3) of the reference, on narrow and wide
    batches, with DEAD cells and a head mask."""
    for lens, hq in (([(64, 2048, 512)], 32), ([(8, 300, 40)] * 6, 16)):
        mb = case_batch((lens, hq, 8, 0.2, "random", 0.2, 3), dtype, 7)
        ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
        out = mb.decode(config=dataclasses.replace(ON, mixed_gluon_fused=True))
        tol = 1e-3 if dtype == torch.float16 else 8e-3
        assert rel_err(out, ref) < tol, rel_err(out, ref)


@needs_gluon_gpu
def test_launch_chain_waits_for_a_long_first_grid() -> None:
    """``pdl_splits``: a long INT2 grid (16,384 positions per request on the Gluon INT2
    split), a short INT4 one and a shorter full one chained behind it. The later grids
    finish long before the first, and each waits for the one before it at its end, so the
    merge reads every INT2 partial row. Twenty calls, each the bits of plain launches (a
    missing wait would let the merge read rows not yet written: ``part_o`` is
    uninitialised memory)."""
    mb = case_batch(([(512, 256, 64)] * 4, 32, 8, 0.1, "random", 0.0, 0), torch.float16, 5)
    plain = mb.decode(config=dataclasses.replace(ON, pdl=False))
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
    assert rel_err(plain, ref) < 1e-3
    chained = dataclasses.replace(ON, pdl_splits=True)
    for _ in range(20):
        assert torch.equal(mb.decode(config=chained), plain)


@needs_gluon_gpu
@pytest.mark.parametrize(("q_scale", "tol"), [(0.05, 1e-3), (1.0, 1e-3), (16.0, 1e-3)])
def test_gluon_split_from_flat_to_sharp_softmax(q_scale, tol) -> None:
    """From near-uniform attention to one dominant token, short to long splits: fp16 output
    within 1e-3 of the reference (the token's key scales are applied in fp32, after the
    dot: no rounding of ``q * ks``)."""
    mb = build_mixed_batch([(0, 1300, 0), (0, 700, 0)], hq=8, hkv=2, d=128, dead_fraction=0.2, seed=3)  # fmt: skip
    mb.q = (mb.q.float() * q_scale).to(torch.float16)
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    for split_len in (128, 1024, None):
        out = mb.decode(config=ON, split_len=split_len)
        assert rel_err(out, ref) < tol, (split_len, rel_err(out, ref))


@needs_gluon_gpu
@pytest.mark.parametrize("cap_factor", [4, 0])
def test_gluon_split_long_splits_keep_the_error(cap_factor) -> None:
    """Splits of 4 x 1,024 positions (its default cap) and one of 16,384 (uncapped), with
    near-uniform attention (the output small beside the sums it is the difference of):
    fp16 output within 1e-3 of the reference (a truncating accumulation reached 1.8e-2 at
    16,384 with the Triton split on the H100, which is why that one is capped at 1,024)."""
    mb = build_mixed_batch([(0, 16384, 0)], hq=8, hkv=2, d=128, seed=6)
    mb.q = mb.q.to(torch.float16)
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    cfg = dataclasses.replace(ON, int4_gluon_cap_factor=cap_factor)
    out = mb.decode(config=cfg, split_len=16384)
    assert rel_err(out, ref) < 1e-3, rel_err(out, ref)


@needs_gluon_gpu
def test_gluon_split_scale_layouts_and_key_channel_scale() -> None:
    """Four separate scale tensors (row stride D / 32) as well as the interleaved buffer, and
    a per-channel key scale (powers of two, folded into the query)."""
    mb = build_mixed_batch([(0, 260, 0), (0, 90, 0)], hq=8, hkv=2, d=128, dead_fraction=0.2, seed=4)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for step in ("interleaved", "separate", "k_channel"):
        if step == "separate":
            separate_int4_scales(mb.pools)
        if step == "k_channel":
            kc = 2.0 ** torch.randint(-2, 3, (2, 128), generator=g)
            mb.pools.int4.k_channel = kc.float().to(mb.q.device)
        ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
        out = mb.decode(config=ON)
        tri = mb.decode(config=OFF)
        assert rel_err(out, ref) < 1e-3 and rel_err(out, tri) < 1e-3, step


@needs_gluon_gpu
@pytest.mark.parametrize(
    "lens", [[(0, 260, 0), (0, 90, 0)], [(4, 100, 0), (3, 60, 0)]], ids=["int4", "mixed"]
)
def test_head_major_int4_pool_gives_the_same_bits(lens) -> None:
    """An INT4 pool with each head's slots adjacent (``head_major``) on the Gluon INT4 split
    and the one mixed launch: the slot-major pool's bits at fixed and planned splits, with
    per-head slot maps, a head mask and separate scale tensors; within 1e-3 of the
    reference."""
    mb = build_mixed_batch(lens, hq=8, hkv=2, d=128, dead_fraction=0.2, head_mask_fraction=0.2, seed=11)  # fmt: skip
    hm = dataclasses.replace(mb, pools=int4_head_major(mb.pools))
    for split_len in (64, None):
        out = hm.decode(config=ON, split_len=split_len)
        assert torch.equal(out, mb.decode(config=ON, split_len=split_len)), split_len
    ref = decode_attention_ref(hm.q, hm.pools, hm.slot_map, hm.seq_lens, hm.head_mask)
    assert rel_err(out, ref) < 1e-3, rel_err(out, ref)
    b, hkv = len(lens), 2
    sm = mb.slot_map[:, None, :].repeat(1, hkv, 1)
    sm[:, 1, 30:70] = 0  # head 1 lost cells
    n2, n4 = (t[:, None].expand(b, hkv).contiguous() for t in (mb.int2_lens, mb.int4_lens))
    args = (sm, n2 + n4)
    kw = dict(int2_lens=n2, int4_lens=n4, split_len=64, config=ON)
    out = decode_attention(hm.q, hm.pools, *args, **kw)
    assert torch.equal(out, decode_attention(mb.q, mb.pools, *args, **kw))
    separate_int4_scales(hm.pools)
    assert torch.equal(hm.decode(config=ON, split_len=64), mb.decode(config=ON, split_len=64))


@needs_gluon_gpu
def test_gluon_split_all_dead_and_empty_requests_give_zeros() -> None:
    mb = build_mixed_batch([(0, 90, 0), (0, 64, 0), (0, 120, 0)], hq=8, hkv=2, d=128, seed=5)
    mb.slot_map = mb.slot_map.clone()
    mb.slot_map[0] = 0  # every position DEAD
    for t in ("seq_lens", "int4_lens"):
        setattr(mb, t, getattr(mb, t).clone())
        getattr(mb, t)[1] = 0
    out = mb.decode(config=ON, split_len=64)
    assert bool((out[:2] == 0).all())
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    assert rel_err(out[2:], ref[2:]) < 1e-3


@needs_gluon_gpu
def test_gluon_split_per_head_slot_maps() -> None:
    """Per-(request, KV head) slot maps and lengths: each head's own cells."""
    mb = build_mixed_batch([(0, 200, 0), (0, 130, 0)], hq=8, hkv=2, d=128, dead_fraction=0.3, seed=8)  # fmt: skip
    b, hkv = 2, 2
    sm = mb.slot_map[:, None, :].repeat(1, hkv, 1)
    sm[:, 1, :70] = 0  # head 1 lost its first 70 tokens
    lens = mb.int4_lens[:, None].expand(b, hkv).contiguous()
    zero = torch.zeros_like(lens)
    out = decode_attention(mb.q, mb.pools, sm, lens, int2_lens=zero, int4_lens=lens, config=ON)
    tri = decode_attention(mb.q, mb.pools, sm, lens, int2_lens=zero, int4_lens=lens, config=OFF)
    ref = decode_attention_ref(mb.q, mb.pools, sm, lens)
    assert rel_err(out, ref) < 1e-3 and rel_err(out, tri) < 1e-3
