"""Fused mixed-precision decode attention (kernels/decode_attention.py) against the torch
reference (kernels/decode_attention_reference.py), and the reference against plain SDPA."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from mixed_batch import (
    KNOBS_ON,
    build_mixed_batch,
    int4_config,
    int4_head_major,
    separate_int4_scales,
)

from agentkv.kernels import (
    DecodeConfig,
    KVPools,
    SegmentMaxLens,
    decode_attention,
    decode_attention_ref,
    dequant_gather_ref,
    plan_split_len,
    validate_decode_inputs,
)
from agentkv.kernels.decode_attention import (
    ChainLink,
    launch_chain,
    plan_wave_splits,
    resident_programs,
)

#: the module (``agentkv.kernels.decode_attention`` the attribute is the function)
dattn = importlib.import_module("agentkv.kernels.decode_attention")

# relative L2 error budget of the fused kernel against the fp32 reference; the CPU
# interpreter truncates fp32 -> bf16 conversions (GPUs round to nearest), hence its margin
TOL = {torch.float16: 3e-3, torch.bfloat16: 3e-2 if torch.cuda.is_available() else 5e-2}


#: the Triton split for every segment, also on a GPU where the Gluon splits would take the
#: quantized ones (the tests of its own caps and chunks)
TRITON_SPLITS = {"int4_gluon": False, "int2_gluon": False}


def _run(mb, dtype, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    out = mb.decode(**kw)
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
    assert out.shape == mb.q.shape and out.dtype == mb.q.dtype
    assert bool(torch.isfinite(out).all())
    rel = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))
    assert rel < TOL[dtype], rel
    return out, ref


CASES = [
    # id: (lens [(int2 pages, int4 tokens, full tokens)], hq, hkv, d, dead, pattern, head_mask)
    ("full_only_mha", [(0, 0, 150)], 4, 4, 64, 0.0, "random", 0.0),
    ("int4_only_gqa4", [(0, 130, 0), (0, 70, 0)], 8, 2, 64, 0.0, "random", 0.0),
    ("int2_only_gqa8", [(4, 0, 0), (2, 0, 0)], 8, 1, 128, 0.0, "random", 0.0),
    ("mixed_gqa2_dead_random", [(2, 40, 30), (1, 90, 5)], 4, 2, 64, 0.5, "random", 0.0),
    ("mixed_gqa16_dead_run", [(3, 20, 20)], 32, 2, 64, 0.4, "run", 0.0),
    ("mixed_gqa32_headmask", [(1, 33, 17), (0, 0, 64), (2, 0, 0)], 32, 1, 64, 0.2, "random", 0.3),
    ("mixed_mha_d128", [(1, 10, 10)], 2, 2, 128, 0.1, "random", 0.0),
    ("short_and_long", [(0, 1, 0), (0, 0, 1), (3, 65, 100)], 4, 1, 64, 0.0, "random", 0.0),
    ("gqa5_odd_group", [(1, 20, 20)], 10, 2, 64, 0.3, "random", 0.2),
]


#: the one-segment cases at both dtypes (each segment's loads convert to the query's dtype);
#: the mixed ones, whose extra features (dead cells, runs, head masks, head dims, groups) are
#: index logic, at one dtype each, alternating (the suite's time budget)
ONE_SEGMENT = {"full_only_mha", "int4_only_gqa4", "int2_only_gqa8"}
DTYPES = (torch.float16, torch.bfloat16)
DTYPE_CASES = [
    (c, dtype)
    for i, c in enumerate(CASES)
    for dtype in (DTYPES if c[0] in ONE_SEGMENT else DTYPES[i % 2 : i % 2 + 1])
]


@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "dead", "pattern", "hm", "dtype"),
    [(*c[1:], dtype) for c, dtype in DTYPE_CASES],
    ids=[f"{c[0]}-{str(dtype).removeprefix('torch.')}" for c, dtype in DTYPE_CASES],
)
def test_matches_reference(lens, hq, hkv, d, dead, pattern, hm, dtype) -> None:
    mb = build_mixed_batch(
        lens,
        hq=hq,
        hkv=hkv,
        d=d,
        dtype=dtype,
        dead_fraction=dead,
        dead_pattern=pattern,
        head_mask_fraction=hm,
        pad=7,
        seed=hq * 31 + d,
    )
    validate_decode_inputs(mb.pools, mb.slot_map, mb.seq_lens, mb.int2_lens, mb.int4_lens)
    _run(mb, dtype, split_len=64)


@given(
    n_req=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4, 8]),
    hkv=st.integers(1, 2),
    d=st.sampled_from([64, 128]),
    dead=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    pattern=st.sampled_from(["random", "run"]),
    split_len=st.sampled_from([64, 128, 256]),
    seed=st.integers(0, 10_000),
    data=st.data(),
)
@settings(max_examples=12, deadline=None)
def test_matches_reference_random(n_req, group, hkv, d, dead, pattern, split_len, seed, data):
    lens = [
        (data.draw(st.integers(0, 3)), data.draw(st.integers(0, 90)), data.draw(st.integers(0, 90)))
        for _ in range(n_req)
    ]
    mb = build_mixed_batch(
        lens,
        hq=group * hkv,
        hkv=hkv,
        d=d,
        dtype=torch.float16,
        dead_fraction=dead,
        dead_pattern=pattern,
        head_mask_fraction=data.draw(st.sampled_from([0.0, 0.3])),
        pad=data.draw(st.integers(0, 40)),
        seed=seed,
    )
    if (
        float(
            decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
            .float()
            .norm()
        )
        == 0.0
    ):
        lens[0] = (0, 0, 1)  # keep one live row so the relative error is defined
        mb = build_mixed_batch(lens, hq=group * hkv, hkv=hkv, d=d, seed=seed)
    _run(mb, torch.float16, split_len=split_len)


def test_reference_equals_sdpa_on_full_pool(device) -> None:
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, n = 2, 8, 2, 64, 50
    pools = KVPools.allocate(2 * n + 1, 0, 0, hkv, d, torch.float32 if False else torch.float16)
    pools.full.k.copy_(torch.randn(pools.full.k.shape, generator=g).half())
    pools.full.v.copy_(torch.randn(pools.full.v.shape, generator=g).half())
    slot_map = torch.stack([torch.randperm(2 * n, generator=g)[:n] + 1 for _ in range(b)]).int()
    seq = torch.full((b,), n, dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=g).half()
    ref = decode_attention_ref(q, pools, slot_map, seq)
    k = pools.full.k[slot_map.long()].float().permute(0, 2, 1, 3)  # [B, Hkv, N, D]
    v = pools.full.v[slot_map.long()].float().permute(0, 2, 1, 3)
    k = k.repeat_interleave(hq // hkv, 1)
    v = v.repeat_interleave(hq // hkv, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], k, v)[:, :, 0]
    torch.testing.assert_close(ref.float(), sdpa, atol=2e-3, rtol=2e-3)


def test_dead_masking_equals_dropping_dead_positions(device) -> None:
    mb = build_mixed_batch([(2, 30, 30)], hq=4, hkv=2, d=64, dead_fraction=0.5, seed=3)
    out = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        split_len=64,
        backend="triton",
    )
    live = mb.slot_map[0, : int(mb.seq_lens[0])]
    live = live[live != 0]
    k, v = dequant_gather_ref(mb.pools, live, out_dtype=torch.float32)  # [n, Hkv, D]
    q = mb.q.float().reshape(1, 2, 2, 64)
    p = torch.softmax(torch.einsum("bhgd,nhd->bhgn", q, k) / math.sqrt(64), -1)
    want = torch.einsum("bhgn,nhd->bhgd", p, v).reshape(1, 4, 64)
    torch.testing.assert_close(out.float(), want, atol=3e-3, rtol=3e-3)


def test_dead_slot_and_padding_are_never_read() -> None:
    mb = build_mixed_batch([(1, 20, 20), (0, 5, 50)], hq=4, hkv=2, d=64, dead_fraction=0.4, seed=5)
    mb.pools.full.k[0] = float("nan")  # the DEAD slot
    mb.pools.full.v[0] = float("nan")
    sm = mb.slot_map.clone()
    for r in range(sm.shape[0]):  # out-of-range garbage after seq_len
        sm[r, int(mb.seq_lens[r]) :] = 1 << 30
    mb.slot_map = sm
    for cfg in (None, DecodeConfig(int4_live_from_scales=False)):
        out, _ = _run(mb, torch.float16, split_len=64, config=cfg)
        assert bool(torch.isfinite(out).all())


def test_all_dead_and_empty_requests_give_zeros() -> None:
    mb = build_mixed_batch([(1, 10, 10), (0, 0, 5), (0, 3, 3)], hq=2, hkv=1, d=64, seed=6)
    sm = mb.slot_map.clone()
    sm[0] = 0  # every position DEAD
    mb.slot_map = sm
    mb.seq_lens = mb.seq_lens.clone()
    mb.seq_lens[1] = 0
    mb.int2_lens = mb.int2_lens.clone()
    mb.int4_lens = mb.int4_lens.clone()
    mb.int4_lens[1] = 0
    out = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        split_len=64,
        backend="triton",
    )
    assert bool((out[0] == 0).all()) and bool((out[1] == 0).all())
    assert bool((out[2] != 0).any())
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    assert bool((ref[:2] == 0).all())


def test_head_mask_changes_only_masked_heads() -> None:
    mb = build_mixed_batch([(1, 40, 40)], hq=4, hkv=2, d=64, seed=8)
    everyone = torch.ones(1, 2, mb.slot_map.shape[1], dtype=torch.bool, device=mb.slot_map.device)
    hm = everyone.clone()
    hm[0, 1, ::2] = False
    # the base run passes an all-True mask: the same compiled variant as the masked run (a
    # launch without a mask compiles other code, whose rounding may differ on a GPU)
    base = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        head_mask=everyone,
        split_len=64,
        backend="triton",
    )
    masked = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        head_mask=hm,
        split_len=64,
        backend="triton",
    )
    assert torch.equal(base[:, :2], masked[:, :2])  # kv head 0 = query heads 0, 1
    assert not torch.allclose(base[:, 2:], masked[:, 2:])


def test_resident_programs_follow_cuda_occupancy() -> None:
    """Registers come from the SM's four sub-partitions: 215 registers hold 8 one-warp
    programs (ncu's register limit on the H100, not 65,536 / (216 x 32) = 9), 168 hold 12;
    the 2-warp full-precision split at 208 registers 4; shared memory (plus the 1 KiB
    reserved per block) and the 32 blocks per SM bound the rest."""
    assert resident_programs(215, 11008, 1) == 8
    assert resident_programs(184, 9000, 1) == 8
    assert resident_programs(168, 9000, 1) == 12
    assert resident_programs(208, 38912, 2) == 4
    assert resident_programs(64, 100_000, 1) == 2  # shared memory bound
    assert resident_programs(16, 0, 1) == 32  # blocks per SM bound
    assert resident_programs(255, 0, 4) == 2


@pytest.mark.parametrize(
    ("heads", "length", "cap", "expected"),
    [
        (256, 4096, 1024, 1024),  # B=32 N=4k: 1,024 programs (one wave), not 2,048 of 512
        (64, 32768, 1024, 1024),  # B=8 N=32k: the cap binds; 2,048 programs (two waves)
        (8, 32768, 1024, 256),  # B=1 N=32k: the shortest split; 1,024 programs
        (128, 8192, 1024, 1024),  # B=16 N=8k: not 9 splits of 960 (1,152: two waves)
        (32, 16384, 1024, 512),
        (512, 2048, 1024, 1024),  # B=64 N=2k: not 5 splits of 448 (2,560: three waves)
    ],
)
def test_wave_plan_fills_whole_waves(heads, length, cap, expected) -> None:
    """The H100 (132 SMs x 8 resident programs) plans of the shapes measured in session 15."""
    (split,) = plan_wave_splits(heads, (length,), (cap,), 132 * 8, 256, 128)
    assert split == expected


@settings(max_examples=300, deadline=None)
@given(
    heads=st.integers(1, 1024),
    lens=st.tuples(st.integers(0, 200_000), st.integers(0, 200_000), st.integers(0, 200_000)),
    caps=st.tuples(st.sampled_from([0, 256, 512, 1024]), st.sampled_from([0, 512, 1024])),
    slots=st.integers(1, 4096),
    min_len=st.sampled_from([64, 256, 300, 512]),
    chunk4=st.booleans(),
)
def test_wave_plan_is_valid_and_never_costs_more_than_one_split_per_wave(
    heads, lens, caps, slots, min_len, chunk4
) -> None:
    """Every split is a multiple of 64, at least ``min_len`` (rounded up to 64) unless a
    cap is shorter, within its segment's cap (or, for a chunked segment, a whole number of
    caps); the plan's modelled cost (waves x (longest split + overhead)) is no more than that
    of the split the w = 1 rule alone gives."""
    caps3 = (*caps, 0)
    chunked = (False, chunk4, False)
    plan = plan_wave_splits(heads, lens, caps3, slots, min_len, 128, chunked=chunked)
    lo = -(-min_len // 64) * 64
    for split, cap, ch in zip(plan, caps3, chunked, strict=True):
        assert split % 64 == 0 and split > 0
        if cap and ch and split > cap:  # a whole number of caps
            assert split % cap == 0
        else:
            assert split <= cap if cap else split >= lo
        assert split >= min(lo, cap) if cap else True

    def cost(ls):
        present = [(m, sl) for m, sl in zip(lens, ls, strict=True) if m]
        waves = -(-heads * sum(-(-m // sl) for m, sl in present) // slots)
        return waves * (max((sl for _, sl in present), default=0) + 128)

    one = plan_wave_splits(heads, lens, caps3, slots, min_len, 128, max_waves=1, chunked=chunked)
    assert cost(plan) <= cost(one)


def test_host_hints_and_auto_split_agree() -> None:
    mb = build_mixed_batch([(2, 50, 0), (1, 70, 0)], hq=4, hkv=2, d=64, seed=9)
    base, _ = _run(mb, torch.float16, split_len=64)
    hinted, _ = _run(
        mb,
        torch.float16,
        max_lens=SegmentMaxLens(int2=64, int4=70, full=0),
        config=DecodeConfig(block_n_int4=64, min_split_len=64, prefetch=False),
    )
    torch.testing.assert_close(base, hinted, atol=2e-3, rtol=2e-3)


def test_plan_split_len() -> None:
    cfg = DecodeConfig()
    cpu = torch.device("cpu")
    assert plan_split_len(1, 1, 10, cpu, cfg) == cfg.min_split_len
    s = plan_split_len(1, 1, 100_000, cpu, cfg)
    assert s % 64 == 0 and s * (cfg.programs_per_sm * 4) >= 100_000


def test_torch_backend_is_the_reference() -> None:
    mb = build_mixed_batch([(1, 9, 9)], hq=2, hkv=1, d=32, seed=10)
    out = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        sm_scale=0.3,
        backend="torch",
    )
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, sm_scale=0.3)
    assert torch.equal(out, ref)


def test_validate_rejects_broken_layouts() -> None:
    mb = build_mixed_batch([(2, 10, 10)], hq=2, hkv=1, d=32, seed=11)
    p, sm = mb.pools, mb.slot_map
    validate_decode_inputs(p, sm, mb.seq_lens, mb.int2_lens, mb.int4_lens)
    swapped = sm.clone()
    swapped[0, [0, 70]] = swapped[0, [70, 0]]  # an INT4 row inside the INT2 segment
    with pytest.raises(ValueError):
        validate_decode_inputs(p, swapped, mb.seq_lens, mb.int2_lens, mb.int4_lens)
    mixed = sm.clone()
    mixed[0, [5, 40]] = mixed[0, [40, 5]]  # two INT2 pages in one 32-position block
    with pytest.raises(ValueError):
        validate_decode_inputs(p, mixed, mb.seq_lens, mb.int2_lens, mb.int4_lens)
    with pytest.raises(ValueError):
        validate_decode_inputs(p, sm, mb.seq_lens, mb.int2_lens - 1, mb.int4_lens)


@pytest.mark.parametrize("d", [32, 256])
def test_triton_path_needs_head_dim_64_or_128(d: int) -> None:
    mb = build_mixed_batch([(1, 9, 9)], hq=2, hkv=1, d=d, seed=12)
    with pytest.raises(ValueError):
        decode_attention(mb.q, mb.pools, mb.slot_map, mb.seq_lens, backend="triton")
    out = decode_attention(mb.q, mb.pools, mb.slot_map, mb.seq_lens, backend="torch")
    assert out.shape == mb.q.shape


INT4_CONFIGS = [
    # the INT4 path's variants (benchmarks/decode_attention.py --tune picks among them)
    ("default", DecodeConfig()),  # every stacked-path knob on, 3 stages
    ("stacked_plain", int4_config(int4_stacked=True)),  # the default before session 10
    ("folded_bn64", int4_config(int4_stacked=False)),
    ("stacked_bn32_w4", int4_config(int4_stacked=True, block_n_int4=32, num_warps=4)),
    ("folded_bn32_pad16", int4_config(int4_stacked=False, block_n_int4=32, min_block_hq=16)),
    ("folded_bn128", int4_config(int4_stacked=False, block_n_int4=128, num_warps=4)),
    ("dequant_v", int4_config(int4_stacked=False, int4_v_fold=False)),
    ("legacy", int4_config(int4_legacy=True, block_n_int4=32)),
    ("imma", int4_config(int4_imma=True)),
    ("imma_lazy_bn64_w2", int4_config(int4_imma=True, int4_lazy_rescale=True, block_n_int4=64)),
    ("stacked_lazy", int4_config(int4_stacked=True, int4_lazy_rescale=True)),
    (
        "imma_lazy_subnormal",
        int4_config(int4_imma=True, int4_lazy_rescale=True, int4_v_subnormal=True),
    ),
    ("stacked_subnormal", int4_config(int4_stacked=True, int4_v_subnormal=True)),
    ("stacked_dots8", int4_config(int4_stacked=True, int4_v_dots8=True)),
    ("imma_all_session10", int4_config(**(KNOBS_ON | {"int4_live_from_scales": False}))),
    ("all_knobs_2_stages", int4_config(**KNOBS_ON, num_stages=2)),
    ("centred", DecodeConfig(int4_v_subnormal=False, int4_v_centred=True)),
    ("centred_plain", int4_config(int4_stacked=True, int4_v_centred=True)),
    ("split_fastest_grid", DecodeConfig(heads_fastest=False)),
    ("value_scales_gathered", DecodeConfig(int4_v_scales_by_dot=False)),
]


#: (group, head_dim, dtype) of the variant tests: every variant at the first two (both
#: dtypes, GQA 4 and 1, D 128 and 64), the main paths at all (the suite's time budget)
INT4_SHAPES = [
    pytest.param(4, 128, torch.float16, id="g4d128-fp16"),
    pytest.param(1, 64, torch.bfloat16, id="g1d64-bf16"),
    pytest.param(4, 128, torch.bfloat16, id="g4d128-bf16"),
    pytest.param(3, 64, torch.float16, id="g3d64-fp16"),
]
INT4_EVERY_SHAPE = {"default", "folded_bn64", "dequant_v", "legacy", "centred"}


def _variant_cases(configs: list[tuple], shapes: list, every_shape: set[str]) -> list:
    """(name, cfg, *shape) params: every config at the first two shapes, those named in
    ``every_shape`` at all of them."""
    return [
        pytest.param(name, cfg, *sh.values, id=f"{sh.id}-{name}")
        for i, sh in enumerate(shapes)
        for name, cfg in configs
        if i < 2 or name in every_shape
    ]


@pytest.mark.parametrize(
    ("name", "cfg", "group", "d", "dtype"),
    _variant_cases(INT4_CONFIGS, INT4_SHAPES, INT4_EVERY_SHAPE),
)
def test_int4_variants_match_reference(name, cfg, group, d, dtype) -> None:
    mb = build_mixed_batch(
        [(0, 90, 0), (1, 40, 9)],
        hq=2 * group,
        hkv=2,
        d=d,
        dtype=dtype,
        dead_fraction=0.3,
        head_mask_fraction=0.2,
        pad=3,
        seed=group * 7 + d,
    )
    _run(mb, dtype, split_len=64, config=cfg)


def test_int4_key_channel_scale_folded_into_query() -> None:
    mb = build_mixed_batch([(0, 100, 0)], hq=8, hkv=2, d=128, seed=21)
    g = torch.Generator().manual_seed(3)
    kc = torch.exp2(torch.randint(-2, 3, (2, 128), generator=g).float()).to(mb.q.device)
    mb.pools.int4.k_channel = kc  # keys read as stored codes * scale * k_channel
    for cfg in (
        int4_config(int4_stacked=True),
        int4_config(int4_stacked=False),
        int4_config(int4_stacked=False, int4_v_fold=False),
        int4_config(int4_legacy=True),
        int4_config(**KNOBS_ON),
    ):
        _run(mb, torch.float16, split_len=64, config=cfg)


@pytest.mark.parametrize("q_scale", [0.25, 4.0, 16.0])
def test_int4_imma_and_lazy_rescale_within_1e3_of_reference(q_scale) -> None:
    """The int8 tensor-core keys (query rows as int8 hi + lo / 256 halves), the lazy
    softmax rescale and the subnormal fp16 value codes keep the fp16 output within 1e-3 (relative L2) of the reference on the
    same quantized K/V, from flat to sharp softmaxes (large q_scale: the running max jumps
    by more than 2**4 between blocks, so the rescale branch runs and is skipped); mixed
    INT2 + INT4 + bf16 segments, DEAD cells and head masks included."""
    mb = build_mixed_batch(
        [(0, 300, 0), (1, 150, 9)],
        hq=8,
        hkv=2,
        d=128,
        dead_fraction=0.2,
        head_mask_fraction=0.2,
        pad=3,
        seed=5,
    )
    mb.q = (mb.q.float() * q_scale).to(torch.float16)
    for cfg in (
        int4_config(int4_imma=True),
        int4_config(int4_imma=True, int4_lazy_rescale=True),
        int4_config(int4_stacked=True, int4_lazy_rescale=True),
        int4_config(int4_imma=True, int4_lazy_rescale=True, int4_v_subnormal=True),
        int4_config(**(KNOBS_ON | {"int4_live_from_scales": False})),
        int4_config(**KNOBS_ON),
        DecodeConfig(int4_v_subnormal=False, int4_v_centred=True),
    ):
        out, ref = _run(mb, torch.float16, split_len=256, config=cfg)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert rel < 1e-3, (cfg, rel)


INT2_CONFIGS = [
    ("fold", DecodeConfig(int2_fold=True)),  # the default (on a GPU: the Gluon split, see below)
    ("fold_lazy", DecodeConfig(int2_gluon=False, int2_fold=True, int2_lazy_rescale=True)),
    ("fold_w1", DecodeConfig(int2_gluon=False, int2_fold=True, num_warps=1)),
    ("fold_v_words", DecodeConfig(int2_gluon=False, int2_v_words=True)),
    ("fold_bytes", DecodeConfig(int2_gluon=False, int2_v_words=False)),
    (
        "fold_hand_prefetch",
        DecodeConfig(int2_gluon=False, int2_pipelined=False),
    ),  # the default before session 14
    ("fold_no_prefetch", DecodeConfig(int2_gluon=False, int2_pipelined=False, prefetch=False)),
    ("fold_pipelined_2_stages", DecodeConfig(int2_gluon=False, num_stages=2)),
    (
        "fold_v_words_lazy_hand_prefetch_w1",
        DecodeConfig(
            int2_gluon=False,
            int2_v_words=True,
            int2_lazy_rescale=True,
            int2_pipelined=False,
            num_warps=1,
        ),
    ),
    (
        "dequantizing",
        DecodeConfig(int2_gluon=False, int2_fold=False),
    ),  # the default before session 11
    ("dequantizing_no_prefetch", DecodeConfig(int2_gluon=False, int2_fold=False, prefetch=False)),
]


@pytest.mark.parametrize(
    ("name", "cfg", "group", "d", "dtype"),
    _variant_cases(
        INT2_CONFIGS,
        [
            pytest.param(4, 128, torch.float16, id="g4d128-fp16"),
            pytest.param(3, 64, torch.bfloat16, id="g3d64-bf16"),
            pytest.param(4, 128, torch.bfloat16, id="g4d128-bf16"),
        ],
        {"fold", "fold_lazy", "dequantizing"},
    ),
)
def test_int2_variants_match_reference(name, cfg, group, d, dtype) -> None:
    """Both INT2 splits (folded: page key scales in the query, token value scales in p,
    codes as fp16 subnormals; dequantizing) on INT2 segments with DEAD cells, head masks and
    shuffled page rows, next to INT4 and full segments."""
    mb = build_mixed_batch(
        [(3, 0, 0), (2, 40, 9)],
        hq=2 * group,
        hkv=2,
        d=d,
        dtype=dtype,
        dead_fraction=0.3,
        head_mask_fraction=0.2,
        pad=3,
        seed=group * 11 + d,
    )
    _run(mb, dtype, split_len=64, config=cfg)


@pytest.mark.parametrize("q_scale", [0.25, 4.0, 16.0])
def test_int2_folded_within_1e3_of_reference(q_scale) -> None:
    """The folded INT2 path keeps the fp16 output within 1e-3 (relative L2) of the reference
    on the same quantized K/V, from flat to sharp softmaxes (the lazy rescale's branch both
    taken and skipped), and agrees with the dequantizing INT2 path to the same bound."""
    mb = build_mixed_batch(
        [(9, 0, 0), (5, 0, 9)], hq=8, hkv=2, d=128, dead_fraction=0.2, pad=3, seed=9
    )
    mb.q = (mb.q.float() * q_scale).to(torch.float16)
    outs = []
    for cfg in (  # this module's folded split (the Gluon one: test_decode_int2_gluon.py)
        DecodeConfig(int2_gluon=False, int2_fold=True),
        DecodeConfig(int2_gluon=False, int2_fold=True, int2_lazy_rescale=True),
        DecodeConfig(int2_gluon=False, int2_pipelined=False),
    ):
        out, ref = _run(mb, torch.float16, split_len=128, config=cfg)
        rel = float((out.float() - ref.float()).norm() / ref.float().norm())
        assert rel < 1e-3, (cfg, rel)
        outs.append(out.float())
    old, _ = _run(mb, torch.float16, split_len=128, config=DecodeConfig(int2_fold=False))
    for out in outs:
        assert float((out - old.float()).norm() / old.float().norm()) < 1e-3


def test_launch_warps_and_stages_follow_the_segments() -> None:
    """num_warps None: 1 where the launch has INT4 or folded INT2 segments (the H100 sweeps'
    winners), 2 for full-precision-only or dequantizing-INT2 launches; num_stages None: 3
    where a split the pipeliner copies ahead runs, else 2."""
    cfg = DecodeConfig()
    assert cfg.warps(has_int4=True) == 1
    assert cfg.warps(has_int4=False, has_int2=True) == 1
    assert cfg.warps(has_int4=False, has_int2=False) == 2
    assert DecodeConfig(int2_fold=False).warps(has_int4=False, has_int2=True) == 2
    assert DecodeConfig(num_warps=4).warps(has_int4=True, has_int2=True) == 4
    # 3 stages where a pipelined split runs (INT4, folded pipelined INT2), else 2
    assert cfg.stages(has_int4=True) == 3
    assert cfg.stages(has_int4=False, has_int2=True) == 3
    assert cfg.stages(has_int4=False, has_int2=False) == 2
    assert DecodeConfig(int2_pipelined=False).stages(has_int4=False, has_int2=True) == 2
    assert DecodeConfig(num_stages=4).stages(has_int4=False, has_int2=True) == 4
    # the folded INT2 split's rescale: eager alone, lazy beside INT4 segments
    assert not cfg.int2_lazy(has_int4=False)
    assert cfg.int2_lazy(has_int4=True)
    assert DecodeConfig(int2_lazy_rescale=False).int2_lazy(has_int4=True) is False


def test_folded_splits_are_capped() -> None:
    """The scale-folded INT4 / INT2 splits never run longer than ``max_split_len_folded``
    positions (their sums cancel; the H100's tensor-core accumulation error grew with the
    split): a longer ``split_len`` gives the capped launch's exact output; with the cap off
    it is honoured (a different split, a different rounding)."""
    mb = build_mixed_batch([(6, 300, 9)], hq=8, hkv=2, d=128, dead_fraction=0.1, seed=13)
    cap = DecodeConfig(max_split_len_folded=64, **TRITON_SPLITS)
    short, _ = _run(mb, torch.float16, split_len=64, config=cap)
    long, _ = _run(mb, torch.float16, split_len=256, config=cap)
    assert torch.equal(short, long)
    uncapped, _ = _run(
        mb,
        torch.float16,
        split_len=256,
        config=DecodeConfig(max_split_len_folded=0, **TRITON_SPLITS),
    )
    assert not torch.equal(short, uncapped)


def _chunk_launch(mb, monkeypatch, **kw) -> tuple[torch.Tensor, list[int]]:
    """The launch's output and its INT4 chunks per program (read from the host plan)."""
    seen: list[int] = []
    real = dattn._split_grid

    def spy(*a):
        grid = real(*a)
        seen.append(grid.k4)
        return grid

    monkeypatch.setattr(dattn, "_split_grid", spy)
    monkeypatch.setattr(dattn, "_PLANS", {})  # (planned afresh: the spy sees the plan made)
    out, _ = _run(mb, torch.float16, **kw)
    monkeypatch.setattr(dattn, "_split_grid", real)
    return out, seen


def test_chunked_int4_programs_give_the_one_program_per_chunk_output(monkeypatch) -> None:
    """``chunked_splits``: an INT4 program longer than the cap runs its chunks one after the
    other, each to its own partial row with a fresh softmax state, so a split of 256 at a
    cap of 64 (4 chunks a program) gives bit for bit the launch with one program per chunk;
    requests whose INT4 segment ends before a program's last chunk (and requests without
    one) leave empty rows the merge skips, and the last program of a head, with fewer rows
    than 4 left, writes no row of the next head. Off, the same split runs capped programs;
    beside INT2 segments, too."""
    mb = build_mixed_batch(
        [(0, 300, 9), (0, 70, 5), (0, 0, 40), (0, 200, 0)],
        hq=8,
        hkv=2,
        d=128,
        dead_fraction=0.2,
        dead_pattern="run",
        seed=21,
    )
    cap = DecodeConfig(max_split_len_folded=64, **TRITON_SPLITS)
    length = mb.slot_map.shape[-1]
    no_int2 = SegmentMaxLens(int2=0, int4=length, full=length)  # the engine's host bounds
    one, k_one = _chunk_launch(mb, monkeypatch, split_len=64, config=cap, max_lens=no_int2)
    chunked, k_chunked = _chunk_launch(mb, monkeypatch, split_len=256, config=cap, max_lens=no_int2)
    assert k_one == [1] and k_chunked == [4]
    if one.is_cuda:  # two compiled variants (INT4_CHUNKS): the same sums, maybe other roundings
        torch.testing.assert_close(chunked, one, atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(one, chunked)
    off_cfg = DecodeConfig(max_split_len_folded=64, chunked_splits=False, **TRITON_SPLITS)
    off, k_off = _chunk_launch(mb, monkeypatch, split_len=256, config=off_cfg, max_lens=no_int2)
    assert k_off == [1]
    torch.testing.assert_close(off, one, atol=1e-3, rtol=1e-3)
    mixed = build_mixed_batch([(2, 300, 9)], hq=8, hkv=2, d=128, seed=22)
    _, k_mixed = _chunk_launch(mixed, monkeypatch, split_len=256, config=cap)
    assert k_mixed == [1]


@pytest.mark.parametrize("block_d", [16, 32, 64])
def test_merge_channel_blocks_give_the_whole_row_merge(block_d: int) -> None:
    """``merge_block_d``: a merge program per (request, query head, channel block) gives
    bit for bit the one-program-per-row merge (the same log-sum-exp weights, the same sums
    per channel), over requests with empty and all-DEAD splits. pdl forced on: the same
    bits (on Hopper the merge is a programmatic dependent launch that waits in-kernel for
    the splits' stores; elsewhere, and interpreted, the plain two-kernel path)."""
    mb = build_mixed_batch(
        [(2, 150, 40), (0, 0, 0), (1, 0, 90)],
        hq=8,
        hkv=2,
        d=128,
        dead_fraction=0.3,
        dead_pattern="run",
        seed=31,
    )
    whole, _ = _run(mb, torch.float16, split_len=64, config=DecodeConfig(merge_block_d=128))
    part, _ = _run(mb, torch.float16, split_len=64, config=DecodeConfig(merge_block_d=block_d))
    assert torch.equal(whole, part)
    assert bool((whole[1] == 0).all())  # nothing live: zeros
    forced, _ = _run(
        mb, torch.float16, split_len=64, config=DecodeConfig(merge_block_d=block_d, pdl=True)
    )
    assert torch.equal(forced, part)  # a dependent launch reads what the splits wrote


@pytest.mark.parametrize(
    ("s_total", "block_s", "block_d"), [(5, 16, 64), (40, 16, 32), (171, 256, 32)]
)
def test_merge_drops_splits_with_nothing_live_whatever_their_rows_hold(
    s_total: int, block_s: int, block_d: int
) -> None:
    """The merge kernel weights each split's partial row by ``2**lse`` and drops the splits
    with nothing live (lse -inf) although it loads their rows (here NaN) beside the lse: the
    torch log-sum-exp merge of the live ones, zeros where a row has none; one step and
    several."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(s_total)
    rows, d = 3, 64
    po = torch.randn(rows, s_total, d, generator=g)
    lse = torch.randn(rows, s_total, generator=g) * 4
    dead = torch.rand(rows, s_total, generator=g) < 0.3
    dead[1] = True  # (a row with nothing live)
    dead[0, 0] = False
    lse[dead] = float("-inf")
    po[dead] = float("nan")
    out = torch.full((rows, 1, d), float("nan"), device=dev)
    dattn._merge_splits_kernel[(rows, d // block_d)](
        po.to(dev), lse.to(dev), out, out.stride(0), out.stride(1), 1, s_total,
        D=d, BLOCK_S=block_s, BLOCK_D=block_d,
    )  # fmt: skip
    m = torch.where(dead, -1.0e30, lse).amax(1, keepdim=True)
    w = torch.where(dead, 0.0, torch.exp2(lse - m))
    ref = (w[..., None] * torch.where(dead[..., None], 0.0, po)).sum(1)
    ref = ref / w.sum(1, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out[:, 0].cpu(), ref, atol=1e-5, rtol=1e-5)
    assert bool((out[1] == 0).all())


def test_launch_chain_orders_the_split_launches() -> None:
    """With pdl, the last split launch that runs lets the merge start early; with the
    splits chained too, the first launch that runs is plain and lets the next one start
    early, and every later one is a programmatic dependent that waits for the one before it
    at its end (so the merge, waiting for the last, sees every grid's partial rows); with
    "last" only the last launch is. A launch that does not run takes no part; without pdl
    every launch is plain."""
    plain = ChainLink(dependent=False, launch_dependents=False)
    first = ChainLink(dependent=False, launch_dependents=True)
    later = ChainLink(dependent=True, launch_dependents=True)
    for chained in (False, True):
        assert launch_chain(True, (False, False, True), chained) == (plain, plain, first)
        assert launch_chain(True, (False, True, False), chained) == (plain, first, plain)
        assert launch_chain(False, (True, True, True), chained) == (plain, plain, plain)
    assert launch_chain(True, (True, True, True)) == (plain, plain, first)
    assert launch_chain(True, (True, False, True)) == (plain, plain, first)
    assert launch_chain(True, (True, True, False)) == (plain, first, plain)
    assert launch_chain(True, (True, True, True), True) == (first, later, later)
    assert launch_chain(True, (False, True, True), True) == (plain, first, later)
    assert launch_chain(True, (True, False, True), True) == (first, plain, later)
    # "last": only the last launch that runs waits for the one before it
    assert launch_chain(True, (True, True, True), "last") == (plain, first, later)
    assert launch_chain(True, (True, False, True), "last") == (first, plain, later)
    assert launch_chain(True, (False, False, True), "last") == (plain, plain, first)
    assert launch_chain(False, (True, True, True), "last") == (plain, plain, plain)


def _assert_binds(kernel, args: tuple, kw: dict) -> None:
    """``kernel(*args, **kw)`` binds every parameter of the real kernel once: the runtime
    parameters positionally, in order, the constexprs by name (those with a default may be
    left out); other keywords are launch options. A launch-argument builder out of step
    with its kernel's signature fails here, on the CPU, not only on a GPU."""
    if hasattr(kernel, "params"):  # a JITFunction
        params = [(p.name, p.is_constexpr, p.has_default) for p in kernel.params]
    else:  # under TRITON_INTERPRET=1: the Python function's signature
        sig = inspect.signature(kernel.fn).parameters.values()
        params = [(p.name, "constexpr" in str(p.annotation), p.default is not p.empty) for p in sig]  # fmt: skip
    assert len(args) <= len(params), (len(args), len(params))
    assert not any(c for _, c, _ in params[: len(args)]), [n for n, _, _ in params]
    rest = params[len(args) :]
    assert all(c for _, c, _ in rest), [n for n, c, _ in rest if not c]
    missing = [n for n, _, d in rest if n not in kw and not d]
    assert not missing, missing


class _LaunchRecorder:
    """Stands in for a kernel: records each launch's keyword arguments (constexprs and
    launch options), grid and positional arguments under the kernel's ``name``, after
    checking that they bind to the ``real`` kernel's parameters (:func:`_assert_binds`)."""

    def __init__(self, name: str, seen: list, real=None) -> None:
        self.name, self.seen, self.real = name, seen, real

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if self.real is not None:
                _assert_binds(self.real, args, kw)
            self.seen.append((self.name, {**kw, "grid": grid, "args": args}))

        return launch


#: the kernels ``decode_attention`` launches, by the short names the launch records use
_KERNEL_NAMES = {
    "int2_split_gluon_kernel": "g2",
    "int4_split_gluon_kernel": "g4",
    "mixed_split_gluon_kernel": "gm",
    "_decode_split_kernel": "tri",
    "_merge_splits_kernel": "merge",
}


def _record_sm90_launches(monkeypatch, sms: int | None = None) -> list:
    """Stand in for an sm_90 GPU (PDL, the Gluon splits wherever asked for; ``sms`` SMs)
    and for every kernel: returns the list each launch appends (short name, keyword
    arguments) to, each launch's arguments checked against the real kernel's signature."""
    seen: list = []
    monkeypatch.setattr(dattn, "_PLANS", {})  # (plans made under the stand-ins stay here)
    for attr, name in _KERNEL_NAMES.items():
        real = getattr(dattn, attr)  # None for a Gluon kernel where Triton has no Gluon
        monkeypatch.setattr(dattn, attr, _LaunchRecorder(name, seen, real))
    monkeypatch.setattr(dattn, "triton_interpreting", lambda: False)
    monkeypatch.setattr(dattn, "_pdl_capable", lambda device: True)
    monkeypatch.setattr(dattn, "_use_gluon_int2", lambda *a: True)
    monkeypatch.setattr(dattn, "_use_gluon_int4", lambda *a: True)
    if sms is not None:
        monkeypatch.setattr(dattn, "_num_sms", lambda device: sms)
    return seen


@pytest.mark.parametrize(
    ("segments", "chained", "expect"),
    [
        # segments: (INT2 pages, INT4 tokens, full tokens) per request; expect: per launch in
        # order, (kernel, launch_pdl, LAUNCH_DEPENDENTS, WAIT_PRIOR), the merge's last
        ("int4", False, [("g4", 0, 1, 0), ("merge", 1, 0, 0)]),
        ("int2", False, [("g2", 0, 1, 0), ("merge", 1, 0, 0)]),
        ("mixed", False, [("g2", 0, 0, 0), ("g4", 0, 1, 0), ("merge", 1, 0, 0)]),
        ("mixed", True, [("g2", 0, 1, 0), ("g4", 1, 1, 1), ("merge", 1, 0, 0)]),
        ("int4_full", False, [("g4", 0, 0, 0), ("tri", 0, 1, 0), ("merge", 1, 0, 0)]),
        ("int4_full", True, [("g4", 0, 1, 0), ("tri", 1, 1, 1), ("merge", 1, 0, 0)]),
        ("all", True, [("g2", 0, 1, 0), ("g4", 1, 1, 1), ("tri", 1, 1, 1), ("merge", 1, 0, 0)]),
        ("full", False, [("tri", 0, 1, 0), ("merge", 1, 0, 0)]),
        ("all", None, [("g2", 0, 0, 0), ("g4", 0, 0, 0), ("tri", 0, 0, 0), ("merge", 0, 0, 0)]),
    ],
)
def test_launches_chain_where_the_gluon_splits_run(monkeypatch, segments, chained, expect):
    """The host side of the launch chain on sm_90 (the GPU, the Gluon dispatch and every
    kernel stood in for; the kernels themselves: test_decode_int4_gluon.py): whichever
    kernel runs the last split launch lets the merge start early, the Triton split runs only
    where a segment is left for it, and with ``pdl_splits`` each later split launch is a
    programmatic dependent that waits for the one before it (``chained`` None: pdl off)."""
    seen = _record_sm90_launches(monkeypatch)
    lens = {
        "int4": (0, 96, 0),
        "int2": (3, 0, 0),
        "mixed": (3, 96, 0),
        "int4_full": (0, 96, 40),
        "all": (3, 96, 40),
        "full": (0, 0, 96),
    }[segments]
    mb = build_mixed_batch([lens, lens], hq=8, hkv=2, d=128, seed=3)
    bounds = SegmentMaxLens(32 * lens[0], lens[1], lens[2])
    cfg = DecodeConfig(
        int2_gluon=True,
        int4_gluon=True,
        pdl=chained is not None,
        pdl_splits=bool(chained),
        resident_programs=8,
        mixed_gluon_fused=False,  # the two Gluon launches (one launch: test_one_mixed_launch)
    )
    mb.decode(config=cfg, max_lens=bounds)
    got = [
        (
            name,
            int(kw.get("launch_pdl", False)),
            int(kw.get("LAUNCH_DEPENDENTS", False)),
            int(kw.get("WAIT_PRIOR", False)),
        )
        for name, kw in seen
    ]
    assert got == expect
    merge = seen[-1][1]
    assert merge["GDC_WAIT"] == (chained is not None)


@pytest.mark.parametrize(
    ("lens", "sms", "pdl", "pdl_splits", "expect"),
    [
        # per request (INT2 pages, INT4 tokens, full tokens); 2 requests x 8 query heads = 16
        # merge rows; expect: per launch (Gluon INT4, Triton, merge), launch_pdl
        ((0, 96, 40), 32, None, False, [0, 0, 1]),  # fewer rows than SMs: a dependent merge
        ((0, 96, 40), 16, None, False, [0, 0, 0]),  # as many rows as SMs: every launch plain
        ((0, 96, 40), 16, None, True, [0, 1, 1]),  # chained splits: on wherever asked for
        ((0, 96, 40), 16, True, False, [0, 0, 1]),  # asked for: on at any width
        ((0, 96, 40), 32, False, False, [0, 0, 0]),  # off
        ((0, 96, 40), 16, None, None, [0, 1, 1]),  # a short full window: chained behind
        ((0, 96, 40), 16, False, None, [0, 0, 0]),  # ... where pdl is on
        ((0, 40, 96), 16, None, None, [0, 0, 0]),  # the full segment longer: not a window
        ((0, 40, 96), 32, None, None, [0, 0, 1]),
    ],
)
def test_default_launch_chain_narrow_merge_and_chained_window(
    monkeypatch, lens, sms, pdl, pdl_splits, expect
):
    """``DecodeConfig.pdl`` None launches the merge as a programmatic dependent only where
    the launch has fewer (request, query head) rows than the GPU has SMs (H200: a gain at
    B=1, a loss at B >= 16; the merge then also splits the channels, ``merge_block_d`` 32),
    or where split launches are chained; ``pdl_splits`` None chains this module's split
    behind the Gluon splits where it runs only a full segment shorter than the quantized
    ones (a recent window: H200, 6-24% faster), and nothing else. The GPU and the kernels
    are stood in for, as above."""
    seen = _record_sm90_launches(monkeypatch, sms)
    mb = build_mixed_batch([lens] * 2, hq=8, hkv=2, d=128, seed=3)
    cfg = DecodeConfig(int4_gluon=True, pdl=pdl, pdl_splits=pdl_splits, resident_programs=8)
    mb.decode(config=cfg, max_lens=SegmentMaxLens(0, lens[1], lens[2]))
    assert [name for name, _ in seen] == ["g4", "tri", "merge"]
    assert [int(kw.get("launch_pdl", False)) for _, kw in seen] == expect
    # the launch before each dependent lets it start early
    assert [int(kw["LAUNCH_DEPENDENTS"]) for _, kw in seen[:2]] == expect[1:]
    merge = seen[-1][1]
    assert merge["GDC_WAIT"] == bool(expect[-1])
    assert merge["BLOCK_D"] == (32 if sms > 16 else 128)


@pytest.mark.parametrize(
    ("tokens", "folded_cap", "resident_cap", "cap_split", "programs"),
    [
        # 2 requests x 2 KV heads on 2 SMs of 16 resident programs (a wave: 32 programs)
        (1024, 1024, 8, 512, 16),  # 8 splits of 128 (one full wave) -> 4 of 256: 16 programs
        (1024, 1024, 0, 512, 32),  # the cap off: the full residency's plan
        (1024, 1024, 16, 512, 32),  # a cap at the residency: the same
        # 8 splits of 512 -> 4 of 1,024, longer than the 512 allowed: kept, unless allowed
        (4096, 1024, 8, 512, 32),
        (4096, 1024, 8, 1024, 16),
        # with splits of at most 192 the plan for 8 a SM would take 44 programs (three
        # waves of 8 programs on 2 SMs): the full residency's 64 of 128 (two waves) stay
        (2048, 192, 8, 512, 64),
    ],
)
def test_int4_gluon_split_planned_for_fewer_longer_programs_in_one_wave(
    monkeypatch, tokens, folded_cap, resident_cap, cap_split, programs
) -> None:
    """The Gluon INT4 split is planned for ``int4_gluon_resident_cap`` programs per SM
    instead of its residency where that plan's programs fit one wave of them and its splits
    stay within ``int4_gluon_resident_cap_split`` positions (H200: 4-8% faster at B=1
    N=32k, B=4 N=16k, B=8 N=4k; longer splits with half their positions DEAD lost 7-12%);
    elsewhere it keeps the plan for its residency. The GPU and the kernels are stood in
    for, as above."""
    seen = _record_sm90_launches(monkeypatch, 2)
    mb = build_mixed_batch([(0, tokens, 0)] * 2, hq=8, hkv=2, d=128, seed=7)
    cfg = DecodeConfig(
        int4_gluon=True,
        resident_programs=16,
        int4_gluon_resident_cap=resident_cap,
        int4_gluon_resident_cap_split=cap_split,
        max_split_len_folded=folded_cap,
        int4_gluon_cap_factor=1,
    )
    mb.decode(config=cfg, max_lens=SegmentMaxLens(0, tokens, 0))
    (g4,) = [kw for name, kw in seen if name == "g4"]
    assert math.prod(g4["grid"]) == programs
    assert seen[-1][1]["args"][6] == programs // 4  # (the merge's S_total: splits per pair)


@pytest.mark.parametrize("knob", ["int4_gluon_resident_cap", "int4_gluon_resident_cap_split"])
def test_int4_gluon_resident_caps_must_not_be_negative(knob) -> None:
    with pytest.raises(ValueError, match=knob):
        DecodeConfig(**{knob: -1})


@pytest.mark.parametrize(
    ("splits", "block_d", "block_s"), [(171, 32, 256), (171, 128, 128), (20, 32, 32), (3, 128, 16)]
)
def test_merge_step_takes_the_splits_up_to_its_tile(monkeypatch, splits, block_d, block_s) -> None:
    """The merge takes a row's splits in steps of the next power of two (at least 16), up
    to ``merge_block_s`` (256) and to a tile of 16,384 fp32 (``16384 // merge_block_d``
    splits): one request of 32k's 171 INT4 splits in one step where it merges 32 channels a
    program, two where it merges 128. The GPU and the kernels are stood in for, as above."""
    seen = _record_sm90_launches(monkeypatch, 132)
    mb = build_mixed_batch([(0, 64 * splits, 0)], hq=8, hkv=2, d=128, seed=5)
    int4_only = SegmentMaxLens(0, 64 * splits, 0)
    mb.decode(split_len=64, config=DecodeConfig(merge_block_d=block_d), max_lens=int4_only)
    name, merge = seen[-1]
    assert name == "merge" and merge["args"][6] == splits  # (S_total)
    assert (merge["BLOCK_S"], merge["BLOCK_D"]) == (block_s, block_d)


@pytest.mark.parametrize(
    ("fused", "sms", "full", "expect"),
    [
        # expect: per launch (kernel, launch_pdl, LAUNCH_DEPENDENTS, WAIT_PRIOR); 2 requests
        # x 8 query heads = 16 merge rows
        (True, 32, 0, [("gm", 0, 1, 0), ("merge", 1, 0, 0)]),  # narrow: dependent merge
        (True, 16, 0, [("gm", 0, 0, 0), ("merge", 0, 0, 0)]),  # wide: plain merge
        (False, 32, 0, [("g2", 0, 0, 0), ("g4", 0, 1, 0), ("merge", 1, 0, 0)]),
        (False, 16, 0, [("g2", 0, 0, 0), ("g4", 0, 0, 0), ("merge", 0, 0, 0)]),
        # a short full window: this module's split chained behind the one Gluon launch
        (True, 32, 40, [("gm", 0, 1, 0), ("tri", 1, 1, 1), ("merge", 1, 0, 0)]),
        (True, 16, 40, [("gm", 0, 1, 0), ("tri", 1, 1, 1), ("merge", 1, 0, 0)]),
    ],
)
def test_one_mixed_launch(monkeypatch, fused, sms, full, expect) -> None:
    """``mixed_gluon_fused`` (the default) runs both Gluon splits as one launch, planned
    together for that grid: per (KV head, request) its grid has the INT2 splits, then the
    INT4 splits, each segment's splits multiples of 64 covering it; it takes the INT2
    launch's place in the launch chain. The GPU and kernels are stood in for, as above."""
    seen = _record_sm90_launches(monkeypatch, sms)
    lens = (3, 96, full)
    mb = build_mixed_batch([lens] * 2, hq=8, hkv=2, d=128, seed=3)
    cfg = DecodeConfig(mixed_gluon_fused=fused, resident_programs=8)
    mb.decode(config=cfg, max_lens=SegmentMaxLens(96, 96, full))
    got = [
        (name, *(int(kw.get(k, False)) for k in ("launch_pdl", "LAUNCH_DEPENDENTS", "WAIT_PRIOR")))
        for name, kw in seen
    ]
    assert got == expect
    if expect[0][0] == "gm":
        kw = seen[0][1]
        assert kw["grid"][0] == 2 and kw["grid"][2] == 2  # (KV head, splits, request)
        len2, len4, _, s2 = kw["args"][-4:]
        assert len2 % 64 == 0 and len4 % 64 == 0
        assert s2 * len2 >= 96 > (s2 - 1) * len2  # 3 INT2 pages
        assert (kw["grid"][1] - s2) * len4 >= 96 > (kw["grid"][1] - s2 - 1) * len4
        assert (kw["NS2"], kw["NS4"]) == (cfg.int2_gluon_stages, cfg.int4_stages(mixed=True))


@pytest.mark.parametrize(
    ("batch", "hkv", "head_major", "stages"),
    [(1, 2, True, 2), (16, 8, True, 2), (1, 2, False, 3), (16, 8, False, 3)],
)
def test_int4_launch_stages_follow_its_pool(monkeypatch, batch, hkv, head_major, stages) -> None:
    """The Gluon INT4 launch over a head-major pool (the store's) runs two cp.async stages,
    narrow or wide; over a slot-major one three (``DecodeConfig.int4_stages``). The GPU and
    kernels are stood in for."""
    seen = _record_sm90_launches(monkeypatch, 132)
    mb = build_mixed_batch(
        [(0, 96, 0)] * batch, hq=2 * hkv, hkv=hkv, d=128, seed=1, int4_head_major=head_major
    )
    mb.decode(config=DecodeConfig(resident_programs=8), max_lens=SegmentMaxLens(0, 96, 0))
    assert seen[0][0] == "g4" and seen[0][1]["NS"] == stages


def test_one_mixed_launch_plans_int4_positions_at_their_cost(monkeypatch) -> None:
    """``mixed_int4_cost``: the one mixed launch plans its segments in INT2 positions, an
    INT4 position counting that many: the INT4 split shortens (a multiple of 64, still
    covering the segment) while the INT2 one keeps its length or grows. Below 1 it is
    refused."""
    seen = _record_sm90_launches(monkeypatch, 132)
    lens = (64, 2048, 0)  # 2,048 INT2 positions, 2,048 INT4 ones per request
    mb = build_mixed_batch([lens] * 2, hq=8, hkv=2, d=128, seed=3)
    got = {}
    for cost in (1.0, 2.0):
        seen.clear()
        cfg = DecodeConfig(mixed_int4_cost=cost, resident_programs=1)
        mb.decode(config=cfg, max_lens=SegmentMaxLens(2048, 2048, 0))
        (name, kw), _merge = seen
        assert name == "gm"
        len2, len4, _, s2 = kw["args"][-4:]
        s4 = kw["grid"][1] - s2
        assert len4 % 64 == 0 and s2 * len2 >= 2048 and s4 * len4 >= 2048 > (s4 - 1) * len4
        got[cost] = (len2, len4)
    assert got[2.0][1] < got[1.0][1] and got[2.0][0] >= got[1.0][0], got
    with pytest.raises(ValueError, match="mixed_int4_cost"):
        DecodeConfig(mixed_int4_cost=0.5)


def test_segment_max_lens_hold_python_ints() -> None:
    """The host bounds size the grid and key the cached split plans: numpy and 0-d integer
    tensor bounds are read into Python ints once; negative or non-integer ones are refused."""
    import numpy as np

    b = SegmentMaxLens(np.int64(64), torch.tensor(96), 0)
    assert (b.int2, b.int4, b.full) == (64, 96, 0)
    assert all(type(x) is int for x in (b.int2, b.int4, b.full))
    with pytest.raises(ValueError, match="SegmentMaxLens.full"):
        SegmentMaxLens(0, 0, -1)
    with pytest.raises(TypeError):
        SegmentMaxLens(0, 1.5, 0)


def test_pdl_splits_is_checked() -> None:
    with pytest.raises(ValueError, match="pdl_splits"):
        DecodeConfig(pdl_splits="first")


@pytest.mark.parametrize("block", [0, 8, 48, 100])
@pytest.mark.parametrize("knob", ["merge_block_d", "merge_block_s"])
def test_merge_blocks_must_be_powers_of_two_of_at_least_16(knob: str, block: int) -> None:
    with pytest.raises(ValueError, match=knob):
        DecodeConfig(**{knob: block})


def test_chunked_wave_plan_runs_past_the_cap() -> None:
    """With chunked INT4 programs the wave plan is not bound by the cap: B=8 N=32k on an
    H100 (64 heads, 1,056 slots) fits one wave of 1,024 programs of 2 chunks of 1,024
    instead of 2,048 capped programs (1.94 waves); an INT2 segment stays capped."""
    slots = 132 * 8
    assert plan_wave_splits(64, (0, 32768, 0), (0, 1024, 0), slots, 256, 128)[1] == 1024
    chunked = (False, True, False)
    plan = plan_wave_splits(64, (0, 32768, 0), (0, 1024, 0), slots, 256, 128, chunked=chunked)
    assert plan[1] == 2048
    # B=1 N=32k: one wave of the shortest split, below the cap, as without chunks
    assert plan_wave_splits(8, (0, 32768, 0), (0, 1024, 0), slots, 256, 128, chunked=chunked) == (
        256,
        256,
        256,
    )
    both = plan_wave_splits(64, (8192, 32768, 0), (1024, 1024, 0), slots, 256, 128, chunked=chunked)
    assert both[0] <= 1024 and (both[1] <= 1024 or both[1] % 1024 == 0)


def test_folded_split_cap_shrinks_with_length() -> None:
    """The cap holds up to ``folded_cap_len`` positions, then shrinks as 1/sqrt(length) (the
    truncation bias it bounds adds up over the request while near-uniform attention's output
    shrinks), in multiples of 64 and never under 256; 0 turns it off."""
    cfg = DecodeConfig()
    assert cfg.folded_split_cap(4096) == cfg.folded_split_cap(32768) == 1024
    assert cfg.folded_split_cap(131072) == 512
    assert cfg.folded_split_cap(65536) == 704  # 1024 / sqrt(2) = 724, down to a multiple of 64
    assert cfg.folded_split_cap(1 << 22) == 256
    assert DecodeConfig(max_split_len_folded=0).folded_split_cap(1 << 20) == 0
    assert DecodeConfig(folded_cap_len=1 << 20).folded_split_cap(131072) == 1024


def test_centred_int4_splits_are_not_capped() -> None:
    """With centred value codes the INT4 sums no longer cancel, so the cap does not apply to
    the INT4 segment: a longer ``split_len`` is honoured (a different rounding), and an INT4
    launch with the cap equals one without it. The centred codes need the magic-number
    conversion: asking for them with subnormal codes is an error, not a silent fallback."""
    mb = build_mixed_batch([(0, 300, 9)], hq=8, hkv=2, d=128, dead_fraction=0.1, seed=13)
    centred = dict(int4_v_subnormal=False, int4_v_centred=True, **TRITON_SPLITS)
    short, _ = _run(mb, torch.float16, split_len=64, config=DecodeConfig(**centred))
    capped, _ = _run(
        mb, torch.float16, split_len=256, config=DecodeConfig(max_split_len_folded=64, **centred)
    )
    free, _ = _run(
        mb, torch.float16, split_len=256, config=DecodeConfig(max_split_len_folded=0, **centred)
    )
    assert torch.equal(capped, free)
    assert not torch.equal(short, capped)
    with pytest.raises(ValueError, match="int4_v_subnormal"):
        DecodeConfig(int4_v_centred=True)


@pytest.mark.parametrize("layout", ["interleaved", "separate", "head_major", "head_major_separate"])
@pytest.mark.parametrize(
    "cfg",
    [DecodeConfig(), DecodeConfig(int4_scale_tile=False), int4_config(int4_legacy=True)],
    ids=["default", "scales_gathered", "legacy"],
)
@pytest.mark.parametrize(("group", "d"), [(4, 128), (3, 64)], ids=["g4d128", "g3d64"])
def test_int4_scale_layouts_match_reference(layout, cfg, group, d) -> None:
    """Both INT4 scale layouts (one interleaved buffer, the default; four tensors), in a
    slot-major and a head-major pool, through the row-tile path, the gathered-scales path
    and the legacy kernel."""
    mb = build_mixed_batch(
        [(1, 70, 9), (0, 45, 0)],
        hq=2 * group,
        hkv=2,
        d=d,
        dtype=torch.float16,
        dead_fraction=0.3,
        head_mask_fraction=0.2,
        seed=group + d,
    )
    if layout.startswith("head_major"):
        mb = dataclasses.replace(mb, pools=int4_head_major(mb.pools))
    if layout.endswith("separate"):
        separate_int4_scales(mb.pools)
    assert mb.pools.int4.head_major is layout.startswith("head_major")
    ss = (1 if layout.endswith("separate") else 4) * (d // 32)
    assert mb.pools.int4.scale_row_stride() == ss
    _run(mb, torch.float16, split_len=64, config=cfg)


def test_int4_scales_of_mixed_layouts_are_refused() -> None:
    mb = build_mixed_batch([(0, 40, 0)], hq=4, hkv=2, d=64, dtype=torch.float16, seed=3)
    mb.pools.int4.k_zero = mb.pools.int4.k_zero.contiguous()  # one tensor off the buffer
    with pytest.raises(ValueError, match="INT4 scale tensors need equal strides"):
        _run(mb, torch.float16)
