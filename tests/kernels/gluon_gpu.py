"""What the Gluon decode splits' GPU tests share: whether this machine runs Gluon kernels,
the skip mark for the tests that need one, the relative error they assert on, and their
reference cases (parametrized, and checked against the torch reference and the Triton
split)."""

from __future__ import annotations

import pytest
import torch
from mixed_batch import build_mixed_batch

from agentkv.kernels import DecodeConfig, SegmentMaxLens, decode_attention_ref
from agentkv.kernels.gluon_fragments import GLUON_AVAILABLE, MIN_CAPABILITY

CUDA = torch.device("cuda")
GLUON_GPU = (
    GLUON_AVAILABLE
    and torch.cuda.is_available()
    and torch.cuda.get_device_capability() >= MIN_CAPABILITY
)
#: skips a test unless a CUDA GPU of compute capability >= 8.0 and a Triton with Gluon are here
needs_gluon_gpu = pytest.mark.skipif(
    not GLUON_GPU, reason="the Gluon decode splits need a CUDA GPU of compute capability >= 8.0"
)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float32."""
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))


#: a reference case's fields after its id: lens [(int2 pages, int4 tokens, full tokens)] per
#: request, Hq, Hkv, DEAD fraction, DEAD pattern, head-mask fraction, slot-map padding
CASE_FIELDS = ("lens", "hq", "hkv", "dead", "pattern", "hm", "pad")


def _over_cases(fn, cases: list[tuple]):
    """``fn`` parametrized over ``cases`` ((id, *CASE_FIELDS) each), ids the cases' ids."""
    ids = [c[0] for c in cases]
    return pytest.mark.parametrize(CASE_FIELDS, [c[1:] for c in cases], ids=ids)(fn)


def reference_cases(cases: list[tuple]):
    """Parametrize a test over ``cases`` ((id, *CASE_FIELDS) each) x fp16 / bf16 x split
    lengths 64, 256 and the planned one."""

    def wrap(fn):
        fn = pytest.mark.parametrize("split_len", [64, 256, None])(fn)
        fn = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])(fn)
        return _over_cases(fn, cases)

    return wrap


def same_bits_cases(cases: list[tuple]):
    """Parametrize a test over ``cases`` ((id, *CASE_FIELDS) each) x split lengths 64 and
    1,024 (fixed: the compared configs may plan different splits)."""

    def wrap(fn):
        return _over_cases(pytest.mark.parametrize("split_len", [64, 1024])(fn), cases)

    return wrap


def case_batch(case: tuple, dtype: torch.dtype, seed: int):
    """The mixed batch of one case (CASE_FIELDS' values), head_dim 128."""
    lens, hq, hkv, dead, pattern, hm, pad = case
    return build_mixed_batch(
        lens,
        hq=hq,
        hkv=hkv,
        d=128,
        dtype=dtype,
        dead_fraction=dead,
        dead_pattern=pattern,
        head_mask_fraction=hm,
        pad=pad,
        seed=seed,
    )


def assert_matches_reference_and_triton(
    case: tuple,
    dtype: torch.dtype,
    split_len: int | None,
    seed: int,
    on: DecodeConfig,
    off: DecodeConfig,
    segment: int,
) -> None:
    """Decode one case (CASE_FIELDS' values) with ``on`` (the Gluon split) and ``off`` (the
    Triton split): finite, and within 1e-3 (fp16; bf16: 8e-3, its rounding) of the float32
    reference and of each other. ``segment``: the Gluon split's (0 INT2, 1 INT4); where
    every request has only that segment, the other quantized one is left out and the host
    bounds say so (one launch, the Gluon kernel alone)."""
    lens = case[0]
    mb = case_batch(case, dtype, seed)
    kw: dict = {"split_len": split_len}
    if all(sum(r) == r[segment] for r in lens):  # that segment only: one launch
        seg_lens = mb.int2_lens if segment == 0 else mb.int4_lens
        bounds = [0, 0, 0]
        bounds[segment] = int(seg_lens.max())
        if segment == 0:
            mb.int4_lens = None
        else:
            mb.int2_lens = None
        kw["max_lens"] = SegmentMaxLens(*bounds)
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
    out = mb.decode(config=on, **kw)
    tri = mb.decode(config=off, **kw)
    assert bool(torch.isfinite(out).all())
    tol = 1e-3 if dtype == torch.float16 else 8e-3
    assert rel_err(out, ref) < tol, rel_err(out, ref)
    assert rel_err(out, tri) < tol, rel_err(out, tri)


def assert_same_bits(case: tuple, split_len: int, seed: int, a: DecodeConfig, b: DecodeConfig):
    """Decode one fp16 case (CASE_FIELDS' values) with ``a`` and ``b``, configs that change
    how a split is scheduled, not what it sums (e.g. its pipeline depth): the same bits, and
    within 1e-3 of the float32 reference."""
    mb = case_batch(case, torch.float16, seed)
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens, mb.head_mask)
    out_a = mb.decode(config=a, split_len=split_len)
    out_b = mb.decode(config=b, split_len=split_len)
    assert torch.equal(out_a, out_b), rel_err(out_a, out_b)
    assert rel_err(out_a, ref) < 1e-3, rel_err(out_a, ref)
