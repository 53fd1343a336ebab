"""INT4 quantize + scatter (kernels/quant_int4.py, kernels/quant_token_groups.py):
Triton against the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kernels import (
    Int4Pool,
    dequantize_int4_ref,
    quantize_int4_ref,
    write_int4,
    write_int4_ref,
)
from agentkv.kernels.quant_token_groups import quantize_token_groups_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FIELDS = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


def _rows(t: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, d, generator=g) * torch.rand(1, h, d, generator=g) * 4
    return (x + torch.randn(d, generator=g)).to(dtype)


def _pools(n: int, h: int, d: int, device: torch.device) -> tuple[Int4Pool, Int4Pool]:
    a = Int4Pool.allocate(n, h, d, device)
    for name in FIELDS:  # poison, to see that only the given slots are written
        getattr(a, name).view(torch.uint8).fill_(0x5A)
    b = Int4Pool(*(getattr(a, f).clone() for f in FIELDS))
    return a, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("t", "h", "d"), [(1, 1, 32), (17, 3, 64), (40, 2, 128), (5, 8, 256)])
def test_write_int4_matches_reference(t, h, d, dtype, device) -> None:
    k, v = _rows(t, h, d, dtype, 1).to(device), _rows(t, h, d, dtype, 2).to(device)
    n = 2 * t + 3
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(t))[:t].to(device)
    a, b = _pools(n, h, d, device)
    write_int4(a, slots.int(), k, v, backend="triton")
    write_int4_ref(b, slots, k, v)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@given(
    t=st.integers(1, 40),
    h=st.integers(1, 4),
    d=st.sampled_from([32, 64, 128]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=12, deadline=None)
def test_write_int4_matches_reference_random_shapes(t, h, d, seed) -> None:
    k = _rows(t, h, d, torch.bfloat16, seed).to(DEVICE)
    v = _rows(t, h, d, torch.bfloat16, seed + 1).to(DEVICE)
    slots = torch.randperm(t + 7, generator=torch.Generator().manual_seed(seed))[:t].to(DEVICE)
    a, b = _pools(t + 7, h, d, DEVICE)
    write_int4(a, slots, k, v, backend="triton")
    write_int4_ref(b, slots, k, v)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_write_int4_into_a_head_major_pool(backend, device) -> None:
    """A head-major pool (each head's slots adjacent rows) holds the same fields after a
    write as a slot-major one: the writer follows the pool's row map."""
    t, h, d = 23, 4, 128
    k, v = (_rows(t, h, d, torch.bfloat16, s).to(device) for s in (5, 6))
    slots = torch.randperm(t + 7, generator=torch.Generator().manual_seed(5))[:t].to(device)
    a = Int4Pool.allocate(t + 7, h, d, device, head_major=True)
    b = Int4Pool.allocate(t + 7, h, d, device)
    write_int4(a, slots, k, v, backend=backend)
    write_int4_ref(b, slots, k, v)
    assert a.head_major and a.k.stride() == (d // 2, (t + 7) * d // 2, 1)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_strided_rows_are_accepted(device) -> None:
    big = _rows(9, 2, 128, torch.float16, 3).to(device)
    k, v = big[:, :, :64], big[:, :, 64:]  # last dim contiguous, rows strided
    slots = torch.arange(9, device=device)
    a, b = _pools(9, 2, 64, device)
    write_int4(a, slots, k, v, backend="triton")
    write_int4_ref(b, slots, k, v)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_int4_error_is_at_most_half_a_step() -> None:
    x = _rows(20, 2, 64, torch.float32, 4)
    codes, scale, zero = quantize_int4_ref(x)
    assert codes.shape == (20, 2, 32) and scale.shape == (20, 2, 2)
    xh = dequantize_int4_ref(codes, scale, zero)
    step = scale.float().repeat_interleave(32, dim=-1)
    assert bool(((x - xh).abs() <= step * 0.52 + 1e-3).all())
    # 4-bit codes keep relative error well under the 2-bit ones
    c2, s2, z2 = quantize_token_groups_ref(x, 2)
    assert c2.shape == (20, 2, 16)


def test_write_int4_torch_backend_on_cpu() -> None:
    k, v = _rows(3, 1, 32, torch.float16, 5), _rows(3, 1, 32, torch.float16, 6)
    a, b = _pools(4, 1, 32, torch.device("cpu"))
    write_int4(a, torch.tensor([3, 0, 2]), k, v, backend="torch")
    write_int4_ref(b, torch.tensor([3, 0, 2]), k, v)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
    assert int(a.k[1].view(-1)[0]) == 0x5A  # slot 1 untouched


def test_shape_errors() -> None:
    p = Int4Pool.allocate(4, 2, 64)
    with pytest.raises(ValueError):
        write_int4(p, torch.arange(3), torch.zeros(3, 2, 64), torch.zeros(3, 2, 32))
    with pytest.raises(ValueError):
        write_int4(p, torch.arange(2), torch.zeros(3, 2, 64), torch.zeros(3, 2, 64))
