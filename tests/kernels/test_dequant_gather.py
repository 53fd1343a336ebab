"""Gather + dequantize for prefill (kernels/dequant_gather.py): Triton against the torch
reference, and the reference against each pool's own dequantizer, for the default
:class:`GatherConfig` and the original kernel (``GATHER_BASE``)."""

from __future__ import annotations

import pytest
import torch
from mixed_batch import int4_head_major, separate_int4_scales

from agentkv.kernels import (
    GATHER_BASE,
    GatherConfig,
    dequant_gather,
    dequant_gather_ref,
    dequantize_int2_keys_ref,
    dequantize_int2_values_ref,
    dequantize_int4_ref,
)

CASES = [
    # (lens per request, hkv, d, dead fraction)
    ([(1, 10, 7)], 1, 32, 0.0),
    ([(2, 5, 20), (0, 9, 3)], 2, 64, 0.3),
    ([(1, 40, 0), (1, 0, 33)], 3, 128, 0.5),
]
CONFIGS = [None, GATHER_BASE]  # None: the default GatherConfig


def _cfg_id(c: GatherConfig | None) -> str:
    return "default" if c is None else "base"


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("lens", "hkv", "d", "dead"), CASES)
def test_triton_matches_reference(
    mixed_batch, lens, hkv, d, dead, dtype, out_dtype, config
) -> None:
    mb = mixed_batch(lens, hq=hkv, hkv=hkv, d=d, dtype=dtype, dead_fraction=dead, pad=5)
    k, v = dequant_gather(
        mb.pools, mb.slot_map, out_dtype=out_dtype, backend="triton", config=config
    )
    kr, vr = dequant_gather_ref(mb.pools, mb.slot_map, out_dtype=out_dtype)
    assert k.shape == (*mb.slot_map.shape, hkv, d) and k.dtype == (out_dtype or dtype)
    # fp32 math in both; only the final rounding to a 16-bit dtype may differ (1 ulp)
    tol = 0 if out_dtype == torch.float32 else (2**-7 if dtype == torch.bfloat16 else 2**-10)
    for a, r in ((k, kr), (v, vr)):
        err = (a.float() - r.float()).abs()
        assert bool((err <= tol * r.float().abs() + 1e-5).all()), float(err.max())
    dead_rows = mb.slot_map == 0
    assert bool((k[dead_rows] == 0).all()) and bool((v[dead_rows] == 0).all())


def test_reference_agrees_with_each_pool(mixed_batch) -> None:
    mb = mixed_batch([(2, 6, 5)], hq=2, hkv=2, d=64, dtype=torch.float16)
    p = mb.pools
    ids = mb.slot_map[0, : int(mb.seq_lens[0])].long()
    k, v = dequant_gather_ref(p, ids, out_dtype=torch.float32)
    for i, s in enumerate(ids.tolist()):
        if s >= p.int2_base:
            page, row = divmod(s - p.int2_base, 32)
            kp = dequantize_int2_keys_ref(
                p.int2.k[page : page + 1],
                p.int2.k_scale[page : page + 1],
                p.int2.k_zero[page : page + 1],
            )[0, :, row]
            vp = dequantize_int2_values_ref(
                p.int2.v[page : page + 1],
                p.int2.v_scale[page : page + 1],
                p.int2.v_zero[page : page + 1],
            )[0, :, row]
        elif s >= p.int4_base:
            j = s - p.int4_base
            kp = dequantize_int4_ref(p.int4.k[j], p.int4.k_scale[j], p.int4.k_zero[j])
            vp = dequantize_int4_ref(p.int4.v[j], p.int4.v_scale[j], p.int4.v_zero[j])
        else:
            kp, vp = p.full.k[s].float(), p.full.v[s].float()
        assert torch.equal(k[i], kp.to(k.device)) and torch.equal(v[i], vp.to(v.device)), i


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
def test_dead_slot_is_never_read(mixed_batch, config) -> None:
    mb = mixed_batch([(1, 8, 8)], hq=1, hkv=1, d=32, dead_fraction=0.5)
    mb.pools.full.k[0] = float("nan")
    mb.pools.full.v[0] = float("nan")
    k, v = dequant_gather(mb.pools, mb.slot_map, backend="triton", config=config)
    assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
def test_custom_dead_id(mixed_batch, config) -> None:
    mb = mixed_batch([(0, 4, 6)], hq=1, hkv=1, d=32)
    dead = int(mb.slot_map[0, -1])  # a full-pool slot used as the dead id
    k, _ = dequant_gather(mb.pools, mb.slot_map, dead_id=dead, backend="triton", config=config)
    kr, _ = dequant_gather_ref(mb.pools, mb.slot_map, dead_id=dead)
    assert bool((k[0, -1] == 0).all()) and bool((k[0, 0] != 0).any())
    torch.testing.assert_close(k.float(), kr.float(), atol=1e-2, rtol=1e-2)


def test_default_config_is_the_h100_winner() -> None:
    c = GatherConfig()
    assert (c.block_t, c.num_warps, c.heads_per_program) == (32, 8, None)
    assert c.int4_words and c.heads_fastest and c.skip_absent and c.int2_tile
    assert c.offsets32 and c.slot_rows and c.store_cache == ".cs"
    assert c.heads(8) == 8 and c.heads(3) == 3  # None: all KV heads in one program
    b = GATHER_BASE
    assert (b.block_t, b.num_warps, b.heads(8), b.store_cache) == (32, 4, 1, "")
    assert b.int4_words and not (b.heads_fastest or b.skip_absent or b.int2_tile)
    assert not (b.offsets32 or b.slot_rows)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_t", 8),
        ("block_t", 24),
        ("block_t", 32.0),
        ("num_warps", 3),
        ("num_warps", 16),
        ("heads_per_program", 0),
        ("store_cache", ".ca"),
        ("skip_absent", 1),
    ],
)
def test_config_rejects_bad_knobs(field, value) -> None:
    with pytest.raises(ValueError, match=f"GatherConfig.{field}"):
        GatherConfig(**{field: value})


def test_config_errors_at_call_time(mixed_batch) -> None:
    mb = mixed_batch([(1, 8, 8)], hq=3, hkv=3, d=32)
    cfg = GatherConfig(heads_per_program=2)
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match="heads_per_program=2 must divide"):
            dequant_gather(mb.pools, mb.slot_map, backend=backend, config=cfg)
    with pytest.raises(TypeError, match="GatherConfig"):
        dequant_gather(mb.pools, mb.slot_map, backend="triton", config={"block_t": 32})
    with pytest.raises(TypeError):  # the knobs are no longer keyword arguments
        dequant_gather(mb.pools, mb.slot_map, backend="triton", block_t=32)


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
def test_head_major_int4_pool_gathers_the_same_bits(mixed_batch, config, per_head) -> None:
    """A head-major INT4 pool (each head's slots adjacent) gathers to the slot-major
    pool's bits (the kernel reads the pool's row map)."""
    mb = mixed_batch([(1, 40, 6), (0, 25, 3)], hq=4, hkv=2, d=128, dead_fraction=0.3)
    slots = mb.slot_map
    if per_head:  # each head its own order of the request's cells
        slots = torch.stack([slots, slots.flip(-1)], dim=-1)
    k, v = dequant_gather(mb.pools, slots, backend="triton", config=config, per_head=per_head)
    hm = int4_head_major(mb.pools)
    k2, v2 = dequant_gather(hm, slots, backend="triton", config=config, per_head=per_head)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    kr, vr = dequant_gather(hm, slots, backend="torch", per_head=per_head)
    assert torch.equal(k2, kr) and torch.equal(v2, vr)


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
def test_separate_int4_scale_tensors_gather_the_same_bits(mixed_batch, config) -> None:
    """The pool interleaves the INT4 scales in one buffer; four separate tensors (the
    kernels read the row stride) gather to the same bits."""
    mb = mixed_batch([(1, 40, 6), (0, 25, 3)], hq=2, hkv=2, d=128, dead_fraction=0.3)
    k, v = dequant_gather(mb.pools, mb.slot_map, backend="triton", config=config)
    separate_int4_scales(mb.pools)
    assert mb.pools.int4.scale_row_stride() == 128 // 32
    k2, v2 = dequant_gather(mb.pools, mb.slot_map, backend="triton", config=config)
    assert torch.equal(k, k2) and torch.equal(v, v2)
