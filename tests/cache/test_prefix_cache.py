import pytest
import torch

from agentkv.cache import DEAD, PoolLayout, PrefixCache, SlotAllocator

L, H = 2, 2
C = L * H


def setup(full_slots=64, int4_slots=16):
    a = SlotAllocator(C, PoolLayout(full_slots, int4_slots))
    return a, PrefixCache(a)


def put(a, pc, tokens, session_id=None, cells=None):
    """Allocate (unless given), insert, drop the inserting caller's reference."""
    own = cells is None
    if own:
        cells = a.alloc(len(tokens))
    node = pc.insert(torch.tensor(tokens), cells, session_id=session_id)
    if own:
        a.decref(cells)
    return cells, node


def test_insert_match_and_split():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3, 4])
    m = pc.match("x", torch.tensor([1, 2, 9]))
    assert m.length == 2 and torch.equal(m.slots, s[:, :2]) and not m.from_session
    assert pc.num_nodes == 2  # split at the match end
    assert pc.match(None, torch.tensor([1, 2, 3, 4, 5])).length == 4
    m = pc.match(None, torch.tensor([7]))
    assert m.length == 0 and m.slots.shape == (C, 0)
    assert pc.match(None, torch.tensor([1, 2, 3, 4]), max_len=3).length == 3
    assert pc.cached_tokens == 4 and pc.held_cells() == 4 * C
    assert bool((a.refcount(s) == 1).all())  # splitting takes no extra reference
    with pytest.raises(ValueError, match="slots must be"):
        pc.insert(torch.tensor([1, 2]), s[:, :1])


def test_shared_insert_keeps_first_copy_and_rejects_holes_and_quantized_cells():
    a, pc = setup()
    s1, _ = put(a, pc, [1, 2, 3])
    s2 = a.alloc(4)
    pc.insert(torch.tensor([1, 2, 3, 4]), s2)
    m = pc.match(None, torch.tensor([1, 2, 3, 4, 5]))
    assert torch.equal(m.slots, torch.cat([s1, s2[:, 3:]], dim=1))
    assert a.decref(s2) == 3 * C  # the duplicates (never taken by the tree) are freed
    holes = a.alloc(2)
    holes[1, 1] = DEAD  # one (layer, head) cell evicted
    with pytest.raises(ValueError, match="intact"):
        pc.insert(torch.tensor([5, 6]), holes)
    quant = holes.clone()
    quant[1, 1] = a.alloc_int4(torch.tensor([1]))[0]
    with pytest.raises(ValueError, match="intact"):
        pc.insert(torch.tensor([5, 6]), quant)


def test_session_namespace_keeps_holes_and_quantized_cells_and_wins_ties():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3, 4])
    sess = s.clone()
    sess[:, 1] = DEAD  # position 1 evicted everywhere
    sess[2, 2] = DEAD  # one column of position 2
    sess[0, 3] = a.alloc_int4(torch.tensor([0]))[0]  # one cell quantized
    pc.insert(torch.tensor([1, 2, 3, 4]), sess, session_id="A")
    a.decref_pairs(torch.tensor([0]), sess[0, 3:])  # the tree now holds the INT4 cell
    m = pc.match("A", torch.tensor([1, 2, 3, 4, 5]))
    assert m.from_session and torch.equal(m.slots, sess)
    other = pc.match("B", torch.tensor([1, 2, 3, 4, 5]))
    assert not other.from_session and torch.equal(other.slots, s)
    # both copies share the full cells they have in common: two references
    assert int(a.refcount(s)[0, 0]) == 2 and int(a.refcount(s)[0, 1]) == 1


def test_session_holes_win_over_a_longer_shared_match():
    a, pc = setup()
    put(a, pc, [1, 2, 3, 4, 5, 6])  # another session's unevicted copy, longer
    sess = a.alloc(4)
    sess[3, 2] = DEAD
    pc.insert(torch.tensor([1, 2, 3, 4]), sess, session_id="A")
    a.decref(sess)
    m = pc.match("A", torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    assert m.from_session and m.length == 4 and int(m.slots[3, 2]) == DEAD
    # without holes, the longer shared match wins
    plain = a.alloc(3)
    pc.insert(torch.tensor([1, 2, 3]), plain, session_id="B")
    a.decref(plain)
    m = pc.match("B", torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    assert not m.from_session and m.length == 6


def test_session_insert_latest_wins():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3], session_id="A")
    v2 = s.clone()
    v2[:, 0] = DEAD
    v2[1, 2] = a.alloc_int4(torch.tensor([1]))[0]
    new = a.alloc(1)
    cells = torch.cat([v2, new], dim=1)
    pc.insert(torch.tensor([1, 2, 3, 4]), cells, session_id="A")
    a.decref(new)
    a.decref_pairs(torch.tensor([1]), v2[1, 2:])
    assert torch.equal(pc.match("A", torch.tensor([1, 2, 3, 4, 5])).slots, cells)
    assert bool((a.refcount(s[:, :1]) == 0).all())  # the old holder's references moved away
    assert int(a.refcount(s)[1, 2]) == 0  # replaced by its quantized cell
    assert int(a.refcount(v2)[1, 2]) == 1


def test_lru_eviction_skips_locked_and_frees_only_unreferenced():
    a, pc = setup(16)
    put(a, pc, [1, 2, 3])
    put(a, pc, [5, 6])
    _, n3 = put(a, pc, [8, 9])
    pc.match(None, torch.tensor([1, 2, 3]))  # refresh: now [5, 6] is the oldest
    pc.lock(n3)
    assert pc.evict(1) == 2 * C
    assert pc.match(None, torch.tensor([5, 6])).length == 0
    assert pc.evict(100) == 3 * C  # [8, 9] is locked
    assert pc.match(None, torch.tensor([8, 9])).length == 2
    pc.unlock(n3)
    with pytest.raises(RuntimeError):
        pc.unlock(n3)
    assert pc.evict(100) == 2 * C and a.free_count == a.capacity
    assert pc.evict(0) == 0


def test_eviction_frees_nothing_a_request_still_holds():
    a, pc = setup()
    s, node = put(a, pc, [1, 2, 3])
    a.incref(s)  # a request's own references
    assert pc.evict(100) == 0 and pc.num_nodes == 0
    assert bool((a.refcount(s) == 1).all())
    a.decref(s)
    assert a.free_count == a.capacity


def test_end_session_and_flush_return_every_cell():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3])
    holes = s.clone()
    holes[:, 2] = DEAD
    holes[0, 1] = a.alloc_int4(torch.tensor([0]))[0]
    new = a.alloc(1)
    pc.insert(torch.tensor([1, 2, 3, 7]), torch.cat([holes, new], dim=1), session_id="A")
    a.decref(new)
    a.decref_pairs(torch.tensor([0]), holes[0, 1:2])
    assert pc.sessions() == ["A"]
    # the session's own cells: the new token in every column and the INT4 cell
    assert pc.end_session("A") == C + 1
    assert pc.sessions() == [] and pc.match("A", torch.tensor([1, 2, 3])).length == 3
    assert pc.end_session("A") == 0
    assert pc.flush() == 3 * C and a.free_count == a.capacity and pc.num_nodes == 0
    assert a.used_cells() == {p: 0 for p in a.used_cells()}


def test_tenant_namespaces_never_match_each_other():
    """A cache salt (tenant namespace) scopes the shared and the session lookups; flush, LRU
    eviction and end_session cover namespaced roots too."""
    a, pc = setup()
    shared_a = a.alloc(4)
    pc.insert(torch.tensor([1, 2, 3, 4]), shared_a, namespace="A")
    a.decref(shared_a)
    holes = a.alloc(3)
    pc.insert(torch.tensor([5, 6, 7]), holes, session_id="s", namespace="A")
    a.decref(holes)
    assert pc.match(None, torch.tensor([1, 2, 3, 4])).length == 0  # default tenant: miss
    assert pc.match("s", torch.tensor([1, 2, 3, 4]), namespace="B").length == 0
    assert pc.match("s", torch.tensor([5, 6, 7]), namespace="B").length == 0
    assert pc.match("s", torch.tensor([5, 6, 7])).length == 0
    hit = pc.match("x", torch.tensor([1, 2, 3, 9]), namespace="A")
    assert hit.length == 3 and torch.equal(hit.slots, shared_a[:, :3])
    assert pc.match("s", torch.tensor([5, 6, 7]), namespace="A").from_session
    assert pc.sessions() == [("A", "s")]
    assert pc.end_session("s") == 0 and pc.end_session("s", namespace="B") == 0
    assert pc.end_session("s", namespace="A") == 3 * C
    assert pc.evict(10**6) == 4 * C and a.free_count == a.capacity and pc.num_nodes == 0
    again = a.alloc(2)
    pc.insert(torch.tensor([1, 2]), again, namespace="A")
    a.decref(again)
    assert pc.flush() == 2 * C and a.free_count == a.capacity


def test_store_caches_a_request_in_its_namespace():
    from agentkv.cache import KVStore

    st = KVStore(L, H, 32, 64)
    req = st.begin_request("s", [1, 2, 3, 4], namespace="A")
    st.extend(req)
    st.finish_request(req)
    assert st.begin_request("s", [1, 2, 3, 4, 5]).num_cached == 0
    other = st.begin_request("s", [1, 2, 3, 4, 5], namespace="B")
    same = st.begin_request("t", [1, 2, 3, 4, 5], namespace="A")
    assert other.num_cached == 0 and same.num_cached == 4
    for r in st.requests():
        st.finish_request(r, cache=False)
    st.check_invariants()
    assert st.end_session("s", namespace="A") == 0
    assert st.flush_prefix_cache() == 4 * L * H
    assert st.stats().free_slots == st.stats().capacity
