import pytest
import torch

from agentkv.cache import DEAD, KVStore, OutOfSlots, SlotRefcountError

from .kv_fill import check_content, fill

L, H, D = 2, 2, 4


def store(num_slots=64):
    return KVStore(L, H, D, num_slots)


def run(st, session, tokens, decode=()):
    """begin + prefill (+ decode) with content written; returns the request."""
    req = st.begin_request(session, tokens)
    fill(st, req, st.extend(req))
    for t in decode:
        fill(st, req, st.extend(req, [t]))
    return req


def test_request_lifecycle_and_prefix_hit():
    st = store()
    r1 = run(st, "A", [1, 2, 3, 4], decode=[5, 6])
    assert r1.num_cached == 0 and r1.seq_len == 6 and r1.token_ids == [1, 2, 3, 4, 5, 6]
    check_content(st, r1)
    st.finish_request(r1)
    st.check_invariants()
    assert st.stats().used_slots == 6  # held by the shared namespace now
    r2 = run(st, "B", [1, 2, 3, 4, 5, 6, 7])
    assert r2.num_cached == 6 and r2.prefix_hit_tokens == 6 and not r2.prefix_from_session
    assert st.stats().used_slots == 7
    check_content(st, r2)
    st.finish_request(r2)
    with pytest.raises(RuntimeError):
        st.finish_request(r2)
    st.flush_prefix_cache()
    st.check_invariants()
    assert st.stats().free_slots == st.stats().capacity


def test_last_prompt_token_is_always_computed():
    st = store()
    st.finish_request(run(st, None, [1, 2, 3]))
    r = st.begin_request(None, [1, 2, 3])
    assert r.num_cached == 2 and r.num_pending == 1
    st.finish_request(r, cache=False)


def test_sibling_requests_share_prefix_and_eviction_in_one_frees_nothing():
    st = store()
    st.finish_request(run(st, "S", [9, 8, 7, 6, 5]))
    a = run(st, "A", [9, 8, 7, 6, 5, 1])
    b = run(st, "B", [9, 8, 7, 6, 5, 2])
    used = st.stats().used_slots
    res = st.evict(a, [0, 1, 2])  # inside the prefix-cache-protected prefix
    assert res.positions_dead == 3 and res.slots_freed == 0
    assert st.stats().used_slots == used
    res = st.evict(a, [5])  # a's own, unshared position
    assert res.positions_dead == 1 and res.slots_freed == 1
    check_content(st, a)
    check_content(st, b)  # b still reads the original slots and K/V
    assert b.slot_map.num_dead == 0
    st.check_invariants()
    for r in (a, b):
        st.finish_request(r)
    st.end_session("A")
    st.end_session("B")
    st.flush_prefix_cache()
    assert st.stats().free_slots == st.stats().capacity


def test_per_head_eviction_frees_only_when_all_heads_go():
    st = store()
    r = run(st, None, [1, 2, 3, 4])
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[0, 0, 1] = False
    res = st.evict_per_head(r, keep)
    assert (res.entries_evicted, res.positions_dead, res.slots_freed) == (1, 0, 0)
    keep[:, :, 1] = False
    res = st.evict_per_head(r, keep)
    assert (res.entries_evicted, res.positions_dead, res.slots_freed) == (L * H - 1, 1, 1)
    rs = st.request_stats(r)
    assert rs.resident_slots == 3 and rs.dead_positions == 1
    assert rs.live_kv_entries == 3 * L * H
    assert rs.resident_bytes == 3 * st.pool.bytes_per_token
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[1, 1, 2] = False
    st.evict_per_head(r, keep)
    assert st.request_stats(r).effective_live_tokens == pytest.approx(3 - 1 / (L * H))
    check_content(st, r)
    k, _, pos, hm = st.read_kv(r, 1)
    assert pos.tolist() == [0, 2, 3] and hm.tolist() == [[True] * 3, [True, False, True]]
    st.check_invariants()
    st.finish_request(r, cache=False)
    assert st.stats().free_slots == st.stats().capacity


def test_extend_evicts_lru_prefix_cache_then_raises_out_of_slots():
    st = store(num_slots=9)  # 8 usable
    st.finish_request(run(st, None, [1, 2, 3, 4]))
    st.finish_request(run(st, None, [5, 6, 7]))
    assert st.stats().free_slots == 1
    r = run(st, None, [10, 11, 12, 13, 14])  # needs 5: evicts the LRU entry [1, 2, 3, 4]
    assert st.prefix_cache.match(None, torch.tensor([1, 2])).length == 0
    assert st.prefix_cache.match(None, torch.tensor([5, 6])).length == 2
    with pytest.raises(OutOfSlots, match="need 4 KV slots"):
        st.extend(r, [1, 2, 3, 4])
    assert r.seq_len == 5 and len(r.token_ids) == 5  # unchanged
    st.check_invariants()
    st.finish_request(r, cache=False)
    st.flush_prefix_cache()
    assert st.stats().free_slots == 8


def test_locked_prefix_is_not_evicted_under_pressure():
    st = store(num_slots=9)
    st.finish_request(run(st, None, [1, 2, 3, 4]))
    r = run(st, None, [1, 2, 3, 4, 5])  # locks [1, 2, 3, 4]
    with pytest.raises(OutOfSlots):
        st.extend(r, [0] * 4)
    assert st.prefix_cache.match(None, torch.tensor([1, 2, 3, 4])).length == 4
    st.finish_request(r)


def test_cache_unfinished_request_shares_system_prompt_before_own_eviction():
    st = store()
    system = [50, 51, 52, 53]
    a = run(st, "A", system + [1, 2])
    assert st.cache_unfinished_request(a, num_tokens=len(system)) == 4
    st.evict(a, [1, 2, 5])  # evicts inside the just-published prompt: memory stays
    b = st.begin_request("B", system + [3])
    assert b.num_cached == 4 and b.slot_map.num_dead == 0
    assert (
        b.slot_map.slots.tolist()
        == st.prefix_cache.match(None, torch.tensor(system)).slots.tolist()
    )
    fill(st, b, st.extend(b))
    check_content(st, b)
    st.check_invariants()
    for r in (a, b):
        st.finish_request(r)
    st.check_invariants()
    for s in ("A", "B"):
        st.end_session(s)
    st.flush_prefix_cache()
    assert st.stats().free_slots == st.stats().capacity


def test_refcount_errors_surface():
    st = store()
    r = run(st, None, [1, 2])
    slot = int(r.slot_map.slots[0])
    st.allocator.decref([slot])  # someone else drops the map's reference by mistake...
    with pytest.raises(SlotRefcountError, match="refcount mismatch"):
        st.check_invariants()
    with pytest.raises(SlotRefcountError, match="double free"):
        st.allocator.decref([slot])


def test_stats_fields():
    st = store()
    r = run(st, "A", [1, 2, 3])
    s = st.stats()
    assert (s.capacity, s.used_slots, s.free_slots) == (63, 3, 60)
    assert s.used_bytes == 3 * s.bytes_per_token and s.pool_bytes == 64 * s.bytes_per_token
    assert s.num_requests == 1 and s.requests_resident_slots == 3
    st.evict(r, [1])
    st.finish_request(r)
    s = st.stats()
    assert s.num_requests == 0 and s.num_sessions == 1 and s.prefix_cache_tokens == 1 + 3
    assert DEAD not in st.allocator.free_slots().tolist()


def test_dead_constant_agrees_with_kernels_pools():
    pools = pytest.importorskip("agentkv.kernels.pools")
    assert pools.DEAD == DEAD


def test_request_without_session_shares_only_its_intact_prefix():
    st = store()
    r = run(st, None, [1, 2, 3, 4, 5], decode=[6])
    st.evict(r, [3])
    st.finish_request(r)
    assert st.stats().num_sessions == 0
    r2 = st.begin_request(None, [1, 2, 3, 4, 5, 6, 7])
    assert r2.num_cached == 3 and r2.slot_map.num_dead == 0  # holes never leak to others
    st.finish_request(r2, cache=False)
    st.flush_prefix_cache()
    assert st.stats().free_slots == st.stats().capacity


def test_evict_per_head_plan_may_cover_a_prefix_of_the_sequence():
    st = store()
    r = run(st, "A", [1, 2, 3], decode=[4, 5])
    keep = torch.zeros(L, H, 3, dtype=torch.bool)  # plan made at prefill time
    res = st.evict_per_head(r, keep)
    assert res.positions_dead == 3 and r.slot_map.slots[3:].ne(DEAD).all()
    with pytest.raises(ValueError):
        st.evict_per_head(r, torch.ones(L, H, 6, dtype=torch.bool))
    st.finish_request(r, cache=False)
    assert st.stats().free_slots == st.stats().capacity


def test_end_session_while_a_request_runs_keeps_its_kv():
    st = store()
    a1 = run(st, "A", [1, 2, 3, 4])
    st.evict(a1, [1])
    st.finish_request(a1)
    a2 = st.begin_request("A", [1, 2, 3, 4, 5])
    assert a2.prefix_from_session
    fill(st, a2, st.extend(a2))
    st.end_session("A")
    check_content(st, a2)  # the request's own references keep its slots
    st.check_invariants()
    st.finish_request(a2)  # re-creates A's namespace with its holes
    assert st.prefix_cache.sessions() == ["A"]
    st.end_session("A")
    st.flush_prefix_cache()
    assert st.stats().free_slots == st.stats().capacity
