import pytest
import torch

from agentkv.cache import DEAD, PrefixCache, SlotAllocator

L, H = 2, 2


def setup(num_slots=64):
    a = SlotAllocator(num_slots)
    return a, PrefixCache(a, L, H)


def put(a, pc, tokens, session_id=None, slots=None, mask=None):
    """Allocate (unless given), insert, drop the inserting caller's reference."""
    own = slots is None
    if own:
        slots = a.alloc(len(tokens))
    node = pc.insert(torch.tensor(tokens), slots, mask, session_id=session_id)
    if own:
        a.decref(slots)
    return slots, node


def test_insert_match_and_split():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3, 4])
    m = pc.match("x", torch.tensor([1, 2, 9]))
    assert m.length == 2 and m.slots.tolist() == s[:2].tolist() and not m.from_session
    assert pc.num_nodes == 2  # split at the match end
    assert pc.match(None, torch.tensor([1, 2, 3, 4, 5])).length == 4
    assert pc.match(None, torch.tensor([7])).length == 0
    assert pc.match(None, torch.tensor([1, 2, 3, 4]), max_len=3).length == 3


def test_shared_insert_keeps_first_copy_and_rejects_holes():
    a, pc = setup()
    s1, _ = put(a, pc, [1, 2, 3])
    s2 = a.alloc(4)
    pc.insert(torch.tensor([1, 2, 3, 4]), s2)
    m = pc.match(None, torch.tensor([1, 2, 3, 4, 5]))
    assert m.slots.tolist() == s1.tolist() + s2[3:].tolist()
    assert a.decref(s2).tolist() == s2[:3].sort().values.tolist()  # duplicates freed
    with pytest.raises(ValueError, match="un-evicted"):
        pc.insert(torch.tensor([5, 6]), torch.tensor([s2[3].item(), DEAD]))


def test_session_namespace_wins_ties_and_keeps_holes():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3, 4])
    holes = s.clone()
    holes[1] = DEAD
    mask = torch.ones(L, H, 4, dtype=torch.bool)
    mask[:, :, 1] = False
    mask[0, 1, 2] = False
    pc.insert(torch.tensor([1, 2, 3, 4]), holes, mask, session_id="A")
    m = pc.match("A", torch.tensor([1, 2, 3, 4, 5]))
    assert m.from_session and m.slots.tolist() == holes.tolist()
    assert torch.equal(m.keep_mask, mask)
    other = pc.match("B", torch.tensor([1, 2, 3, 4, 5]))
    assert not other.from_session and other.slots.tolist() == s.tolist()
    assert other.keep_mask is None


def test_session_insert_latest_wins():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3], session_id="A")
    v2 = s.clone()
    v2[0] = DEAD
    new = a.alloc(1)
    pc.insert(torch.tensor([1, 2, 3, 4]), torch.cat([v2, new]), session_id="A")
    a.decref(new)
    assert pc.match("A", torch.tensor([1, 2, 3, 4, 5])).slots[:3].tolist() == v2.tolist()
    assert int(a.refcount(s[:1])[0]) == 0  # the old holder's reference moved away


def test_lru_eviction_skips_locked_and_frees_only_unreferenced():
    a, pc = setup(16)
    put(a, pc, [1, 2, 3])
    put(a, pc, [5, 6])
    _, n3 = put(a, pc, [8, 9])
    pc.match(None, torch.tensor([1, 2, 3]))  # refresh: now [5, 6] is the oldest
    pc.lock(n3)
    assert pc.evict(1) == 2
    assert pc.match(None, torch.tensor([5, 6])).length == 0
    assert pc.evict(100) == 3  # [8, 9] is locked
    assert pc.match(None, torch.tensor([8, 9])).length == 2
    pc.unlock(n3)
    with pytest.raises(RuntimeError):
        pc.unlock(n3)
    assert pc.evict(100) == 2 and a.free_count == a.capacity


def test_end_session_and_flush_return_every_slot():
    a, pc = setup()
    s, _ = put(a, pc, [1, 2, 3])
    holes = s.clone()
    holes[2] = DEAD
    new = a.alloc(1)
    pc.insert(torch.tensor([1, 2, 3, 7]), torch.cat([holes, new]), session_id="A")
    a.decref(new)
    assert pc.sessions() == ["A"]
    assert pc.end_session("A") == 1  # only the new token: the rest is shared
    assert pc.sessions() == [] and pc.match("A", torch.tensor([1, 2, 3])).length == 3
    assert pc.flush() == 3 and a.free_count == a.capacity and pc.num_nodes == 0


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
    assert hit.length == 3 and hit.slots.tolist() == shared_a[:3].tolist()
    assert pc.match("s", torch.tensor([5, 6, 7]), namespace="A").from_session
    assert pc.sessions() == [("A", "s")]
    assert pc.end_session("s") == 0 and pc.end_session("s", namespace="B") == 0
    assert pc.end_session("s", namespace="A") == 3
    assert pc.evict(100) == 4 and a.free_count == a.capacity and pc.num_nodes == 0
    again = a.alloc(2)
    pc.insert(torch.tensor([1, 2]), again, namespace="A")
    a.decref(again)
    assert pc.flush() == 2 and a.free_count == a.capacity


def test_store_caches_a_request_in_its_namespace():
    from agentkv.cache import KVStore

    st = KVStore(2, 2, 4, 64)
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
    assert st.flush_prefix_cache() == 4 and st.stats().free_slots == st.stats().capacity
