"""INT2 page quantization (kernels/quant_int2.py): keys per channel over a 32-token page,
values per token; Triton against the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kernels import (
    Int2Pool,
    dequantize_int2_keys_ref,
    dequantize_int2_values_ref,
    quantize_int2_keys_ref,
    quantize_int2_values_ref,
    write_int2_pages,
    write_int2_pages_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FIELDS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


def _rows(p: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32 * p, h, d, generator=g) * torch.rand(1, h, d, generator=g) * 3
    return (x + 2 * torch.randn(d, generator=g)).to(dtype)


def _pools(n: int, h: int, d: int, device: torch.device) -> tuple[Int2Pool, Int2Pool]:
    a = Int2Pool.allocate(n, h, d, device)
    for name in FIELDS:
        getattr(a, name).view(torch.uint8).fill_(0xA5)
    b = Int2Pool(*(getattr(a, f).clone() for f in FIELDS))
    return a, b


def _check(p, h, d, dtype, seed, device) -> None:
    k = _rows(p, h, d, dtype, seed).to(device)
    v = _rows(p, h, d, dtype, seed + 1).to(device)
    n = p + 2
    pages = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:p].to(device)
    a, b = _pools(n, h, d, device)
    write_int2_pages(a, pages.int(), k, v, backend="triton")
    write_int2_pages_ref(b, pages, k, v)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("p", "h", "d"), [(1, 1, 32), (2, 3, 64), (3, 2, 128), (1, 2, 256)])
def test_write_int2_matches_reference(p, h, d, dtype, device) -> None:
    _check(p, h, d, dtype, 7, device)


@given(
    p=st.integers(1, 3),
    h=st.integers(1, 3),
    d=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=10, deadline=None)
def test_write_int2_matches_reference_random_shapes(p, h, d, seed) -> None:
    _check(p, h, d, torch.bfloat16, seed, DEVICE)


def test_int2_keys_are_per_channel_values_per_token() -> None:
    x = _rows(2, 2, 64, torch.float32, 9).reshape(2, 32, 2, 64)
    codes, scale, zero = quantize_int2_keys_ref(x)
    assert codes.shape == (2, 2, 32, 16) and scale.shape == (2, 2, 64)
    xt = x.permute(0, 2, 1, 3)
    assert torch.equal(zero, xt.amin(2).half())  # zero point = channel min over the page
    kh = dequantize_int2_keys_ref(codes, scale, zero)
    assert bool(((kh - xt).abs() <= scale.float()[:, :, None, :] * 0.52 + 1e-3).all())
    vc, vs, vz = quantize_int2_values_ref(x)
    assert vc.shape == (2, 2, 32, 16) and vs.shape == (2, 2, 32, 2)
    assert torch.equal(vz, xt.reshape(2, 2, 32, 2, 32).amin(-1).half())
    vh = dequantize_int2_values_ref(vc, vs, vz)
    step = vs.float().repeat_interleave(32, dim=-1)
    assert bool(((vh - xt).abs() <= step * 0.52 + 1e-3).all())


def test_partial_pages_are_rejected() -> None:
    p = Int2Pool.allocate(2, 1, 32)
    with pytest.raises(ValueError):
        write_int2_pages(p, torch.arange(1), torch.zeros(31, 1, 32), torch.zeros(31, 1, 32))
