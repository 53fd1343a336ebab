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


def test_int4_row_maps_of_both_layouts() -> None:
    """Slot-major rows (a slot's heads adjacent) and head-major rows (a head's slots
    adjacent) are both read through one row map; layouts the kernels cannot read raise."""
    from agentkv.kernels import Int4Pool, Int4RowMap

    slot_major = Int4Pool.allocate(10, 4, 128)
    head_major = Int4Pool.allocate(10, 4, 128, head_major=True)
    assert slot_major.row_map() == Int4RowMap(4, 1, 16, True) and not slot_major.head_major
    assert head_major.row_map() == Int4RowMap(1, 10, 16, True) and head_major.head_major
    assert head_major.scales_interleaved and head_major.scale_row_stride() == 16
    assert head_major.k.shape == slot_major.k.shape == (10, 4, 64)
    # (slot 3, head 2) lies at row 2 * 10 + 3 of the head-major buffers
    head_major.k[3, 2, 5] = 7
    head_major.v_zero[3, 2, 1] = 2.0
    assert head_major.k.transpose(0, 1).reshape(-1, 64)[23, 5] == 7
    flat = torch.as_strided(head_major.k_scale, (4 * 10 * 16,), (1,))  # the one scale buffer
    assert flat[23 * 16 + 3 * 4 + 1] == 2.0  # row 23's [ks | kz | vs | vz], vz's group 1
    # separate scale tensors, rows in the codes' order
    sep = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (head_major.k_scale,) * 4]
    assert Int4Pool(head_major.k, head_major.v, *sep).row_map() == Int4RowMap(1, 10, 4)
    bad = {
        "placed as the code rows": (head_major.k, head_major.v, *(slot_major.k_scale,) * 4),
        "equal strides": (head_major.k, slot_major.v, *(head_major.k_scale,) * 4),
        "overlap": (slot_major.k[:1].expand(10, 4, 64),) * 2 + (slot_major.k_scale,) * 4,
    }
    for why, fields in bad.items():
        with pytest.raises(ValueError, match=why):
            Int4Pool(*fields).row_map()
    one = Int4Pool.allocate(5, 1, 64, head_major=True)  # one head: the layouts coincide
    assert one.row_map() == Int4RowMap(1, 0, 8, True) and not one.head_major
    p = KVPools.allocate(4, 6, 1, num_kv_heads=2, head_dim=64, int4_head_major=True)
    assert p.int4.head_major and p.int4.row_map() == Int4RowMap(1, 6, 8, True)


def test_row_map_is_read_again_when_the_pool_holds_other_tensors() -> None:
    """``row_map`` is remembered while the pool holds the same six tensors (one check per
    pool, not per kernel call), and read again from any tensor set in their place: other
    scale tensors give their layout, and a layout no kernel reads raises after a good one
    was read."""
    from agentkv.kernels import Int4Pool, Int4RowMap

    pool = Int4Pool.allocate(10, 4, 128, head_major=True)
    first = pool.row_map()
    assert pool.row_map() is first and first == Int4RowMap(1, 10, 16, True)
    sep = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in (pool.k_scale,) * 4]
    pool.k_scale, pool.k_zero, pool.v_scale, pool.v_zero = sep
    assert pool.row_map() == Int4RowMap(1, 10, 4) and not pool.scales_interleaved
    pool.v = Int4Pool.allocate(10, 4, 128).v  # slot-major values beside head-major keys
    with pytest.raises(ValueError, match="equal strides"):
        pool.row_map()


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


@pytest.mark.parametrize("head_major", [False, True])
def test_the_test_batches_pools_move_between_devices(head_major: bool) -> None:
    """The GPU tests' mixed batches move their pools to the GPU (``mixed_batch._pools_to``)
    after the torch writers ran on the CPU; a pool that has remembered its row map (an
    ``init=False`` field, not a tensor) moves too, with the same rows and its layout kept.
    Run on the CPU (a move to the same device), so a change that breaks every GPU test is
    seen without one (session 28: it was not, for a session)."""
    from mixed_batch import _pools_to

    p = KVPools.allocate(4, 6, 2, num_kv_heads=2, head_dim=64, int4_head_major=head_major)
    rows = p.int4.row_map()
    moved = _pools_to(p, torch.device("cpu"))
    assert moved.int4.row_map() == rows
    assert torch.equal(moved.int4.k, p.int4.k) and torch.equal(moved.int2.v, p.int2.v)
    assert moved.int4.k.stride() == p.int4.k.stride()
