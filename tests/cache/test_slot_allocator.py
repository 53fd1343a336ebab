import pytest
import torch

from agentkv.cache import DEAD, OutOfSlots, SlotAllocator, SlotRefcountError


def test_dead_slot_is_reserved_and_never_handed_out():
    a = SlotAllocator(9)
    assert a.capacity == 8 and a.free_count == 8
    got = a.alloc(8)
    assert DEAD not in got.tolist()
    assert sorted(got.tolist()) == list(range(1, 9))
    assert a.free_count == 0
    assert a.refcount(got).tolist() == [1] * 8


def test_out_of_slots_is_clear_and_takes_nothing():
    a = SlotAllocator(5)
    a.alloc(3)
    with pytest.raises(OutOfSlots, match="need 2 KV slots but only 1 of 4 are free"):
        a.alloc(2)
    assert a.free_count == 1


def test_refcounts_free_only_at_zero():
    a = SlotAllocator(6)
    s = a.alloc(2)
    a.incref(s)
    assert a.decref(s).numel() == 0  # 2 -> 1
    assert a.free_count == 3
    freed = a.decref(s)
    assert sorted(freed.tolist()) == sorted(s.tolist())
    assert a.free_count == 5


def test_repeated_entries_count_each():
    a = SlotAllocator(4)
    (s,) = a.alloc(1).tolist()
    a.incref([s, s])
    assert int(a.refcount([s])[0]) == 3
    assert a.decref([s, s, s]).tolist() == [s]


def test_double_free_raises_and_changes_nothing():
    a = SlotAllocator(4)
    s = a.alloc(2)
    a.decref(s[:1])
    before = a.refcount()
    with pytest.raises(SlotRefcountError, match="double free"):
        a.decref(s)  # s[0] is already free; s[1] would be fine
    assert torch.equal(a.refcount(), before)
    assert a.free_count == 2


def test_incref_of_free_slot_dead_or_out_of_range_raises():
    a = SlotAllocator(4)
    with pytest.raises(SlotRefcountError, match="free slot"):
        a.incref([1])
    with pytest.raises(SlotRefcountError, match="dead slot"):
        a.decref([DEAD])
    with pytest.raises(SlotRefcountError, match="out of range"):
        a.decref([4])


def test_freed_slots_are_reused_first_and_free_list_has_no_duplicates():
    a = SlotAllocator(6)
    s = a.alloc(3)
    a.decref(s[1:2])
    assert a.alloc(1).tolist() == s[1:2].tolist()
    free = a.free_slots().tolist()
    assert len(free) == len(set(free)) and DEAD not in free
