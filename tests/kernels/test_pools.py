"""Pool layout (kernels/pools.py) and backend choice (kernels/backend.py)."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels import DEAD, KVPools, resolve_backend
from agentkv.kernels.backend import triton_interpreting
from agentkv.kernels.pools import row_stride


def test_unified_address_space() -> None:
    p = KVPools.allocate(10, 6, 2, num_kv_heads=2, head_dim=64)
    assert DEAD == 0
    assert (p.int4_base, p.int2_base, p.num_unified_slots) == (10, 16, 16 + 64)
    assert p.int4_slot_ids(torch.tensor([0, 5])).tolist() == [10, 15]
    ids = p.int2_slot_ids(torch.tensor([1]))
    assert ids.shape == (1, 32) and ids[0, 0] == 16 + 32 and ids[0, 31] == 16 + 63
    assert p.int4.k.shape == (6, 2, 32) and p.int4.k_scale.shape == (6, 2, 2)
    assert p.int2.k.shape == (2, 2, 32, 16) and p.int2.k_scale.shape == (2, 2, 64)
    assert p.int2.v_scale.shape == (2, 2, 32, 2)


def test_row_stride_of_pools_fields_and_views() -> None:
    """Evenly spaced contiguous rows give their spacing; anything else None."""
    p = KVPools.allocate(4, 6, 0, num_kv_heads=8, head_dim=128)
    i4 = p.int4
    assert row_stride(i4.k) == 64
    # the interleaved scale buffer's four fields: rows 4 x D / 32 apart
    assert {row_stride(t) for t in (i4.k_scale, i4.k_zero, i4.v_scale, i4.v_zero)} == {16}
    assert i4.scale_row_stride() == 16 and i4.scales_interleaved
    x = torch.zeros(6, 8, 10)
    assert row_stride(x) == 10 and row_stride(x[:, :, :4]) == 10
    assert row_stride(x.transpose(0, 1)) is None  # rows out of order
    assert row_stride(x[:, ::2]) == 20  # every other row: still evenly spaced
    assert row_stride(x[:, :4]) is None  # rows 10 apart, then a jump of 50
    assert row_stride(x[:, :, ::2]) is None  # a row not contiguous
    assert row_stride(x[:1]) == 10 and row_stride(torch.zeros(5)) == 5
    assert row_stride(torch.zeros(1, 3).expand(4, 3)) is None  # rows overlap
    assert row_stride(torch.zeros(1, 3).expand(1, 3)) == 3


def test_absent_pools_and_bytes() -> None:
    p = KVPools.allocate(4, 0, 0, num_kv_heads=8, head_dim=128)
    assert p.int4 is None and p.int2 is None and p.int2_base == p.int4_base == 4
    b = p.bytes_per_token()
    assert b["full"] == 2 * 8 * 128 * 2
    assert b["int4"] == 2 * 8 * (64 + 16)
    assert b["int2"] == 8 * (32 + 16) + 8 * (32 + 16)
    assert b["full"] / b["int4"] == pytest.approx(3.2)


@pytest.mark.parametrize("d", [48, 96, 16])
def test_head_dim_must_be_power_of_two_multiple_of_32(d: int) -> None:
    with pytest.raises(ValueError):
        KVPools.allocate(4, 4, 1, num_kv_heads=1, head_dim=d)


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_interpreting()
    assert resolve_backend("auto", cpu) == "torch"
    with pytest.raises(RuntimeError):
        resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("auto", cpu) == "triton"
    with pytest.raises(ValueError):
        resolve_backend("cuda", cpu)  # type: ignore[arg-type]
