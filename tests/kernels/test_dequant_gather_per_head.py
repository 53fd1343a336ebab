"""dequant_gather with per-(layer, head) slot maps (``per_head=True``, slots ``[..., Hkv]``):
Triton (interpreter on CPU) against the torch reference, and both against the shared-map
gather of each head's own column, for the default :class:`GatherConfig`, the original kernel
(``GATHER_BASE``) and the launch / memory variants between them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agentkv.kernels import DEAD, GATHER_BASE, GatherConfig, dequant_gather, dequant_gather_ref


def per_head_slots(mb, n: int, seed: int, dead: float) -> torch.Tensor:
    """int64 ``[n, Hkv]``: each head its own mix of INT2 / INT4 / full ids and DEAD."""
    g = torch.Generator().manual_seed(seed)
    p = mb.pools
    ids = mb.slot_map[mb.slot_map != DEAD].long().cpu().unique()
    assert bool((ids >= p.int2_base).any()) and bool(
        ((ids >= p.int4_base) & (ids < p.int2_base)).any()
    )
    cols = []
    for _ in range(p.num_kv_heads):
        pick = ids[torch.randint(0, ids.numel(), (n,), generator=g)]
        pick[torch.rand(n, generator=g) < dead] = DEAD
        cols.append(pick)
    return torch.stack(cols, dim=1).to(mb.slot_map.device)


CASES = [
    # (lens per request, hkv, d, rows, dead fraction)
    ([(1, 10, 7)], 1, 32, 19, 0.0),
    ([(2, 5, 20), (0, 9, 3)], 2, 64, 45, 0.3),
    ([(1, 40, 8)], 3, 32, 70, 0.5),
]
CONFIGS = [None, GATHER_BASE]  # None: the default GatherConfig


def _cfg_id(c: GatherConfig | None) -> str:
    return "default" if c is None else "base"


@pytest.mark.parametrize("config", CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("lens", "hkv", "d", "rows", "dead"), CASES)
def test_per_head_triton_matches_reference(mixed_batch, lens, hkv, d, rows, dead, dtype, config):
    mb = mixed_batch(lens, hq=hkv, hkv=hkv, d=d, dtype=dtype)
    slots = per_head_slots(mb, rows, seed=rows, dead=dead)
    k, v = dequant_gather(
        mb.pools, slots, out_dtype=torch.float32, backend="triton", per_head=True, config=config
    )
    kr, vr = dequant_gather_ref(mb.pools, slots, out_dtype=torch.float32, per_head=True)
    assert k.shape == (rows, hkv, d) and k.dtype == torch.float32
    assert torch.equal(k, kr) and torch.equal(v, vr)  # fp32 math in both, no final rounding
    # in the pool dtype only the final rounding may differ (the CPU interpreter truncates
    # fp32 -> bf16): 1 ulp
    k16, _ = dequant_gather(mb.pools, slots, backend="triton", per_head=True, config=config)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    assert k16.dtype == dtype
    assert bool(((k16.float() - kr).abs() <= ulp * kr.abs() + 1e-6).all())
    dead_rows = slots == DEAD  # [rows, Hkv]
    assert bool((k[dead_rows] == 0).all()) and bool((v[dead_rows] == 0).all())
    if dead_rows.any() and (~dead_rows).any():
        assert bool((k[~dead_rows].abs().sum(-1) > 0).all())  # a live cell is never zeroed


def test_per_head_reads_each_heads_own_column(mixed_batch):
    """Head h of row i is cell (slots[i, h], h): the shared-map gather of column h, head h."""
    mb = mixed_batch([(1, 12, 12)], hq=2, hkv=2, d=32, dtype=torch.float16)
    slots = per_head_slots(mb, 33, seed=3, dead=0.2)
    k, v = dequant_gather(mb.pools, slots, out_dtype=torch.float32, backend="triton", per_head=True)
    for h in range(2):
        ks, vs = dequant_gather(mb.pools, slots[:, h], out_dtype=torch.float32, backend="triton")
        assert torch.equal(k[:, h], ks[:, h]) and torch.equal(v[:, h], vs[:, h])
    # every head on the same map = the shared-map gather
    same = slots[:, :1].expand(-1, 2)
    k1, v1 = dequant_gather(
        mb.pools, same, out_dtype=torch.float32, backend="triton", per_head=True
    )
    k2, v2 = dequant_gather(mb.pools, slots[:, 0], out_dtype=torch.float32, backend="triton")
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_per_head_leading_dims_and_empty(mixed_batch):
    mb = mixed_batch([(1, 8, 8)], hq=2, hkv=2, d=32)
    slots = per_head_slots(mb, 12, seed=4, dead=0.25).view(3, 4, 2)
    k, v = dequant_gather(mb.pools, slots, backend="triton", per_head=True)
    kr, vr = dequant_gather_ref(mb.pools, slots, per_head=True)
    assert k.shape == (3, 4, 2, 32)
    assert torch.equal(k, kr) and torch.equal(v, vr)
    k0, _ = dequant_gather(mb.pools, slots[:0].reshape(0, 2), backend="triton", per_head=True)
    assert k0.shape == (0, 2, 32)
    with pytest.raises(ValueError, match="per-head slots"):
        dequant_gather(mb.pools, slots[..., :1], backend="triton", per_head=True)
    with pytest.raises(ValueError, match="per-head slots"):
        dequant_gather_ref(mb.pools, slots[..., :1], per_head=True)


def test_per_head_dead_slot_is_never_read(mixed_batch):
    mb = mixed_batch([(1, 8, 8)], hq=2, hkv=2, d=32)
    mb.pools.full.k[DEAD] = float("nan")
    mb.pools.full.v[DEAD] = float("nan")
    slots = per_head_slots(mb, 40, seed=5, dead=0.5)
    k, v = dequant_gather(mb.pools, slots, backend="triton", per_head=True)
    assert bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())
    assert bool((k[slots == DEAD] == 0).all())


def test_int4_word_and_byte_unpacking_agree(mixed_batch) -> None:
    mb = mixed_batch([(1, 40, 9)], hq=4, hkv=2, d=128, dead_fraction=0.3, seed=17)
    slots = mb.slot_map[0, : int(mb.seq_lens[0])][:, None].expand(-1, 2).contiguous()
    r = dequant_gather(mb.pools, slots, per_head=True, backend="torch")
    for cfg in (GatherConfig(), GATHER_BASE):
        a = dequant_gather(mb.pools, slots, per_head=True, backend="triton", config=cfg)
        no_words = replace(cfg, int4_words=False)
        b = dequant_gather(mb.pools, slots, per_head=True, backend="triton", config=no_words)
        for x, y, z in zip(a, b, r, strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)


# launch / memory knobs of dequant_gather (GatherConfig; benchmarks/dequant_gather.py sweeps
# them on the GPU): the original kernel with knobs added, the default with knobs removed;
# each must give the default kernel's output bit for bit
_BASE_VARIANTS = [
    dict(),
    dict(heads_fastest=True),
    dict(heads_fastest=True, heads_per_program=2),
    dict(heads_per_program=2),
    dict(heads_fastest=True, heads_per_program=2, block_t=16),
    dict(skip_absent=True),
    dict(store_cache=".cs"),
    dict(int2_tile=True),
    dict(int2_tile=True, int4_words=False),
    dict(int2_tile=True, skip_absent=True, heads_fastest=True, heads_per_program=2),
    dict(int2_tile=True, skip_absent=True, store_cache=".cs"),
    dict(offsets32=True),
    dict(offsets32=True, skip_absent=True, int2_tile=True, heads_fastest=True),
    dict(offsets32=True, skip_absent=True, int2_tile=True, heads_per_program=2, block_t=64),
    dict(slot_rows=True),
    dict(slot_rows=True, heads_fastest=True, heads_per_program=2, skip_absent=True),
    dict(slot_rows=True, offsets32=True, skip_absent=True, int2_tile=True, store_cache=".cs"),
]
_DEFAULT_VARIANTS = [
    dict(),
    dict(heads_per_program=1),
    dict(slot_rows=False),
    dict(heads_fastest=False, block_t=64, num_warps=4),
    dict(store_cache=""),
]
VARIANTS = [replace(GATHER_BASE, **d) for d in _BASE_VARIANTS] + [
    replace(GatherConfig(), **d) for d in _DEFAULT_VARIANTS
]
_NAMES = [("base" + "".join(f",{k}={v}" for k, v in d.items())) for d in _BASE_VARIANTS] + [
    ("default" + "".join(f",{k}={v}" for k, v in d.items())) for d in _DEFAULT_VARIANTS
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=_NAMES)
@pytest.mark.parametrize(
    ("sort", "hkv", "d"),
    [(False, 2, 64), (True, 4, 32)],
    ids=["mixed-hkv2-d64", "runs-hkv4-d32"],
)  # the two column orders on one head shape each (the suite's time budget)
def test_variants_match_default_and_reference(mixed_batch, cfg, sort, hkv, d) -> None:
    """Random per-head mixes (every block holds every precision) and sorted columns (runs of
    DEAD, full, INT4, INT2: blocks with absent precisions, which ``skip_absent`` branches
    over), in fp32 (equal to the reference) and in the pool dtype (equal to the default)."""
    mb = mixed_batch([(2, 30, 9), (1, 12, 5)], hq=hkv, hkv=hkv, d=d, dtype=torch.bfloat16)
    slots = per_head_slots(mb, 77, seed=7 + hkv, dead=0.2)
    if sort:
        slots = slots.sort(dim=0).values
    kr, vr = dequant_gather_ref(mb.pools, slots, out_dtype=torch.float32, per_head=True)
    k, v = dequant_gather(
        mb.pools, slots, out_dtype=torch.float32, backend="triton", per_head=True, config=cfg
    )
    assert torch.equal(k, kr) and torch.equal(v, vr)
    k0, v0 = dequant_gather(mb.pools, slots, backend="triton", per_head=True)
    k1, v1 = dequant_gather(mb.pools, slots, backend="triton", per_head=True, config=cfg)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    # the shared map (one id for every head) through the same knobs
    ks, vs = dequant_gather(
        mb.pools, slots[:, 0], out_dtype=torch.float32, backend="triton", config=cfg
    )
    ksr, vsr = dequant_gather_ref(mb.pools, slots[:, 0], out_dtype=torch.float32)
    assert torch.equal(ks, ksr) and torch.equal(vs, vsr)


def test_variants_with_key_channel_scale(mixed_batch) -> None:
    mb = mixed_batch([(1, 40, 8)], hq=2, hkv=2, d=64, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    mb.pools.int4.k_channel = (2.0 ** torch.randint(-2, 3, (2, 64), generator=g)).to(
        mb.pools.full.k.device
    )
    slots = per_head_slots(mb, 50, seed=9, dead=0.1)
    kr, vr = dequant_gather_ref(mb.pools, slots, out_dtype=torch.float32, per_head=True)
    for cfg in VARIANTS:
        k, v = dequant_gather(
            mb.pools, slots, out_dtype=torch.float32, backend="triton", per_head=True, config=cfg
        )
        assert torch.equal(k, kr) and torch.equal(v, vr), cfg


def test_heads_per_program_must_divide_hkv(mixed_batch) -> None:
    mb = mixed_batch([(1, 8, 8)], hq=3, hkv=3, d=32)
    slots = per_head_slots(mb, 10, seed=1, dead=0.0)
    with pytest.raises(ValueError, match="heads_per_program=2 must divide"):
        dequant_gather(
            mb.pools,
            slots,
            backend="triton",
            per_head=True,
            config=GatherConfig(heads_per_program=2),
        )
    # the default (None: all heads) and 3 / 1 heads per program are fine
    kr, vr = dequant_gather_ref(mb.pools, slots, per_head=True)
    for hp in (None, 3, 1):
        cfg = GatherConfig(heads_per_program=hp)
        k, v = dequant_gather(mb.pools, slots, backend="triton", per_head=True, config=cfg)
        assert torch.equal(k, kr) and torch.equal(v, vr), hp
