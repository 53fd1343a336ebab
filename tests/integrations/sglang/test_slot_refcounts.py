"""``RefCountedTokenAllocator`` without host syncs on the request paths: frees and tree
references only queue device work, the pending slots are settled once per read of the free
list, and the counts, the free list and the evictable / protected sizes stay exactly what the
eager code (and stock SGLang) gives."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from agentkv.integrations.sglang.request_plan import request_state
from agentkv.integrations.sglang.runtime import _dead_in_prefix
from agentkv.integrations.sglang.slot_refcounts import (
    RefCountedTokenAllocator,
    SlotRefcountError,
)
from agentkv.policies import FullCache, StreamingLLM
from agentkv.wire import KVPayload, encode_payload


def allocator(size: int = 64, need_sort: bool = False) -> RefCountedTokenAllocator:
    a = RefCountedTokenAllocator(size, torch.float32, "cpu", None, need_sort=need_sort)
    a.strict = False  # a server's setting
    return a


def payload(session: str, policy=None) -> str:
    return encode_payload(KVPayload(session_id=session, policy=policy or FullCache()))


def tokens(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(10, 30000) for _ in range(n)]


def test_frees_and_tree_references_queue_no_host_read(host_reads):
    a = allocator()
    reads = host_reads
    with reads:
        got = a.alloc(10)
        a.tree_incref(got[:6])
        a.pin(got[:6], +1)
        a.free(torch.cat((got, torch.tensor([a.dead_slot, 0]))))  # DEAD, slot 0: weight 0
        a.pin(got[:6], -1)
        a.tree_decref(got[:6])
    assert reads.count == 0, reads.ops
    assert a.pending_slots == 18 and len(a._free_pages) == a.size - 1 - 10  # not settled yet
    with reads:
        assert a.available_size() == a.size - 1  # one settle: one host read
    assert reads.ops == ["tolist"]
    with reads:
        assert a.available_size() == a.size - 1  # nothing pending: no read
        assert a.physical_sizes() == (0, 1)  # (folded into the settle above)
    assert reads.count == 0, reads.ops
    a.check()


def test_a_settle_and_a_size_recount_share_one_host_read(host_reads):
    a = allocator()
    got = a.alloc(8)
    a.tree_incref(got)
    a.free(got[:5])
    reads = host_reads
    with reads:
        assert a.physical_sizes() == (5, 1)
    assert reads.ops == ["tolist"]
    assert a.pending_slots == 0
    with reads:
        assert a.physical_sizes() == (5, 1)
        assert a.available_size() == a.size - 1 - 8
    assert reads.count == 0


def _model_sizes(holdings, pinned, size):
    """Recount from the holders: (free, evictable, protected)."""
    count, tree_count, pins = Counter(), Counter(), Counter()
    for kind, slots in holdings.values():
        for s in slots:
            count[s] += 1
            if kind == "tree":
                tree_count[s] += 1
    for h in pinned:
        for s in holdings[h][1]:
            pins[s] += 1
    used = [s for s in count if count[s] > 0]
    tree_only = [s for s in used if count[s] == tree_count[s]]
    evictable = sum(1 for s in tree_only if pins[s] == 0)
    protected = sum(1 for s in tree_only if pins[s] > 0) + 1
    return size - 1 - len(used), evictable, protected, set(used)


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_randomised_deferred_frees_match_a_recount(seed, need_sort):
    """2,000 random operations (allocations, partial and whole request frees with DEAD and
    slot 0 mixed in, tree references taken, pinned, unpinned and dropped, SGLang's free group
    around some of them): the free list never hands out a held slot, and at every read
    ``available_size`` and ``physical_sizes`` equal a recount from the holders."""
    g = random.Random(seed)
    a = allocator(size=300, need_sort=need_sort)
    dead = a.dead_slot
    holdings: dict[int, tuple[str, list[int]]] = {}
    pinned: set[int] = set()
    next_id = 0
    handed: set[int] = set()
    for step in range(2000):
        op = g.random()
        reqs = [h for h, (k, _) in holdings.items() if k == "req"]
        trees = [h for h, (k, _) in holdings.items() if k == "tree"]
        if op < 0.25:
            got = a.alloc(g.randrange(1, 12))
            if got is not None:
                slots = got.tolist()
                _, _, _, used = _model_sizes(holdings, pinned, a.size)
                assert not (set(slots) & used), "a held slot was handed out again"
                assert len(set(slots)) == len(slots)
                assert dead not in slots and 0 not in slots
                handed |= set(slots)
                holdings[next_id] = ("req", slots)
                next_id += 1
        elif op < 0.45 and reqs:
            h = g.choice(reqs)
            slots = holdings[h][1]
            k = g.randrange(0, len(slots) + 1)
            gone, keep = slots[:k], slots[k:]
            junk = [dead] * g.randrange(0, 3) + [0] * g.randrange(0, 2)
            group = g.random() < 0.3
            if group:
                a.free_group_begin()
            a.free(torch.tensor(gone + junk, dtype=torch.int64))
            if group and trees and g.random() < 0.5:  # the tree lets go inside the group
                t = g.choice([t for t in trees if t not in pinned] or [None])
                if t is not None:
                    a.tree_decref(torch.tensor(holdings.pop(t)[1], dtype=torch.int64))
            if group:
                a.free_group_end()
            if keep:
                holdings[h] = ("req", keep)
            else:
                del holdings[h]
        elif op < 0.6 and reqs:
            slots = holdings[g.choice(reqs)][1]
            sub = slots[: g.randrange(1, len(slots) + 1)]
            a.tree_incref(torch.tensor(sub + [dead], dtype=torch.int64))
            holdings[next_id] = ("tree", sub)
            next_id += 1
        elif op < 0.7 and trees:
            t = g.choice(trees)
            if t in pinned:
                pinned.discard(t)
                a.pin(torch.tensor(holdings[t][1], dtype=torch.int64), -1)
            else:
                pinned.add(t)
                a.pin(torch.tensor(holdings[t][1], dtype=torch.int64), +1)
        elif op < 0.8 and trees:
            t = g.choice([t for t in trees if t not in pinned] or [None])
            if t is not None:
                a.tree_decref(torch.tensor(holdings.pop(t)[1], dtype=torch.int64))
        else:
            free, evictable, protected, _ = _model_sizes(holdings, pinned, a.size)
            assert a.available_size() == free
            assert a.physical_sizes() == (evictable, protected)
        if step % 200 == 0:
            a.check()
    for t in list(pinned):
        a.pin(torch.tensor(holdings[t][1], dtype=torch.int64), -1)
    for kind, slots in holdings.values():
        let_go = a.tree_decref if kind == "tree" else a.free
        let_go(torch.tensor(slots, dtype=torch.int64))
    a.check()
    assert a.available_size() == a.size - 1
    assert a.physical_sizes() == (0, 1)
    assert len(handed) > 200, "the free list should be recycled"
    everything = a.alloc(a.size - 1)
    assert sorted(everything.tolist()) == list(range(1, a.size))


def test_faults_are_raised_at_the_next_settle_or_at_once_when_strict():
    a = allocator()
    got = a.alloc(4)
    a.free(got)
    a.free(got[:1])  # a double free: queued, found at the settle
    with pytest.raises(SlotRefcountError, match="more often than referenced"):
        a.available_size()
    b = allocator()
    got = b.alloc(4)
    b.free(got)
    b.tree_incref(got[:2])  # a tree reference on a slot whose count reached 0
    with pytest.raises(SlotRefcountError, match="free slot"):
        b.available_size()
    c = allocator()
    c.strict = True
    got = c.alloc(4)
    c.free(got)
    with pytest.raises(SlotRefcountError, match="more often than referenced"):
        c.free(got[:1])
    for strict in (True, False):  # freed at once though another holder holds it
        d = allocator()
        d.strict = strict
        got = d.alloc(4)
        d.tree_incref(got[:2])
        if strict:
            with pytest.raises(SlotRefcountError, match="release_owned"):
                d.release_owned(got)
            with pytest.raises(SlotRefcountError, match="drop_refs"):
                d.drop_refs(got)  # slots 2, 3: the tree does not hold them
        else:
            d.release_owned(got)
            with pytest.raises(SlotRefcountError, match="other holders"):
                d.check()


def test_owned_slots_are_freed_at_once_and_tree_held_ones_stay(host_reads):
    a = allocator()
    got = a.alloc(6)
    a.tree_incref(got[3:])  # inserted: the tree holds 3.., the request's 0..2 are duplicates
    reads = host_reads
    with reads:
        a.release_owned(got[:3])
        a.drop_refs(got[3:])
        assert a.available_size() == a.size - 1 - 3
        a.release_owned(got[3:], tree=True)  # the leaf evicted
        assert a.available_size() == a.size - 1
    assert reads.count == 0, reads.ops
    a.check()
    assert a.physical_sizes() == (0, 1)


def test_pending_frees_do_not_alias_the_callers_buffer():
    a = allocator()
    got = a.alloc(4)
    buf = got.clone()
    a.free(buf)
    buf.fill_(a.dead_slot)  # SGLang reuses its index buffers
    assert a.available_size() == a.size - 1
    a.check()


def test_adopt_turns_sglangs_allocator_into_a_counted_one():
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    plain = TokenToKVPoolAllocator(32, torch.float32, "cpu", None, need_sort=True)
    a = RefCountedTokenAllocator.adopt(plain)
    assert a is plain and "free_pages" not in a.__dict__
    assert a.available_size() == 31 and a.dead_slot not in a.free_pages.tolist()
    a.strict = False
    got = a.alloc(31)
    assert a.alloc(1) is None
    a.free(got)
    assert len(a.release_pages) == 31  # need_sort: freed slots wait in release_pages
    assert sorted(a.alloc(31).tolist()) == list(range(1, 32))  # merged, sorted, handed out


def test_free_group_frees_once(monkeypatch):
    """SGLang's decode-result step: frees inside a free group are applied at its end, through
    ``free``; a tree decref inside the group must not be counted down again there."""
    a = allocator()
    got = a.alloc(6)
    a.tree_incref(got[:3])
    a.free_group_begin()
    a.free(got)  # queued in the group: nothing counted yet
    assert a.pending_slots == 0 and int(a.refs[got].sum()) == 9
    a.tree_decref(got[:3])
    a.free_group_end()
    assert a.available_size() == a.size - 1
    a.check()
    assert (a.refs == 0).all()


def test_fullcache_and_stock_requests_need_no_host_read_in_the_tree(steps, host_reads):
    """A FullCache request and one without payload, through SGLang's real radix cache and
    release path: no host read in the tree's insert, free and lock steps, in the free /
    evictable / protected sizes admission asks for, or in LRU eviction (as stock SGLang), and
    ``before_extend``'s DEAD count of a prefix matched in the shared namespace costs none
    either. Every count recounted afterwards."""
    steps.alloc.strict = False
    reads = host_reads
    system = tokens(24, 7)
    first = steps.request(system + tokens(8, 1), payload("s1"), extra_key="t")
    steps.prefill(first)
    steps.decode(first, [11, 12, 13])
    steps.finish(first)
    for i, pl in enumerate([payload("s2"), None]):
        req = steps.request(system + tokens(8, 10 + i), pl, extra_key="t", rid=f"r{i}")
        steps.prefill(req, plan=False)
        assert len(req.prefix_indices) == 24  # the shared system prompt
        state = request_state(req)
        with reads:
            if state is not None:
                assert _dead_in_prefix(req, state, steps.alloc.dead_slot) == 0
                state.planned = True
            steps.cache.cache_unfinished_req(req)  # SGLang's post-prefill insert
        steps.decode(req, [21, 22])
        steps.alloc.free_group_begin()
        with reads:
            from sglang.srt.mem_cache.common import release_kv_cache

            release_kv_cache(req, steps.cache, is_insert=True)
            steps.alloc.free_group_end()
            # admission's sizes: the allocator's free list (nothing pending: the row's
            # duplicates were freed at once) and the tree's own counters (no alias)
            assert steps.alloc.pending_slots == 0
            free = steps.alloc.available_size()
            sizes = steps.cache.evictable_size(), steps.cache.protected_size()
        assert reads.count == 0, reads.ops
        assert sizes == steps.alloc.physical_sizes()  # == the recount
        assert free + sum(sizes) == steps.alloc.size  # SGLang's idle invariant
    with reads:  # LRU eviction of unaliased leaves: freed at once too
        steps.cache.evict(EvictParams(num_tokens=10**9))
        assert steps.alloc.available_size() == steps.alloc.size - 1
    assert reads.count == 0, reads.ops
    assert steps.cache.session_tokens == 0
    steps.cache.check_invariants()


def test_a_sessions_holey_prefix_is_still_counted(steps):
    """The other side of the shortcut: a prefix matched in a session's namespace (holes) is
    counted on the device."""
    ids = tokens(40, 3)
    req = steps.request(ids, payload("s9", StreamingLLM(budget=16, sinks=4)), extra_key="t")
    steps.prefill(req)
    steps.finish(req)
    nxt = steps.request(ids + tokens(6, 4), payload("s9"), extra_key="t", rid="n")
    steps.prefill(nxt, plan=False)
    state = request_state(nxt)
    assert state.intact_prefix is None
    assert _dead_in_prefix(nxt, state, steps.alloc.dead_slot) == 24
