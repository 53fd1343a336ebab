"""Plans on SGLang's real pools and radix cache: DEAD redirect, reference-counted frees,
hole-preserving session namespaces, tenant isolation, and a randomised soak."""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey

from agentkv.integrations.sglang.request_plan import HOLEY
from agentkv.policies import FullCache, StreamingLLM
from agentkv.wire import KVPayload, encode_payload


def payload(session: str, policy=None) -> str:
    return encode_payload(KVPayload(session_id=session, policy=policy or FullCache()))


def tokens(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(10, 30000) for _ in range(n)]


def evict_all(steps) -> None:
    steps.cache.evict(EvictParams(num_tokens=10**9))


def test_dead_slot_is_reserved_and_not_slot_0(steps):
    a = steps.alloc
    assert a.dead_slot == a.size != 0
    assert a.available_size() == a.size - 1
    got = a.alloc(a.size - 1)
    assert a.dead_slot not in got.tolist() and 0 not in got.tolist()
    assert a.alloc(1) is None
    a.free(got)
    a.free(torch.tensor([a.dead_slot]))  # ignored, not a double free
    assert a.available_size() == a.size - 1
    a.check()


def test_plan_redirects_to_dead_and_frees_the_evicted_slots(steps):
    ids = tokens(40, 1)
    req = steps.request(ids, payload("s1", StreamingLLM(budget=16, sinks=4)))
    steps.prefill(req, plan=False)
    before = steps.row(req).clone()
    free_before = steps.alloc.available_size()
    from agentkv.integrations.sglang.request_plan import request_state
    from agentkv.integrations.sglang.runtime import plan_one

    evicted = plan_one(steps.planner, steps.r2t, steps.alloc, req, request_state(req))
    row = steps.row(req)
    dead = steps.alloc.dead_slot
    assert evicted == 24
    assert (row[4:28] == dead).all()
    assert torch.equal(row[:4], before[:4]) and torch.equal(row[28:], before[28:])
    assert steps.alloc.available_size() == free_before + 24
    assert set(before[4:28].tolist()) <= set(steps.alloc.free_pages.tolist())
    # kept positions still read back their own token and position
    pos = torch.cat((torch.arange(4), torch.arange(28, 40)))
    k = steps.kv.get_key_buffer(1)[row[pos]]
    assert torch.equal(k, steps.kv_value(torch.tensor(ids)[pos], pos))
    assert HOLEY.count >= 1
    steps.finish(req)
    steps.cache.check_invariants()


def test_dead_is_never_freed_and_every_slot_comes_back(steps):
    for s in range(3):
        req = steps.request(tokens(60, s), payload(f"s{s}", StreamingLLM(budget=20, sinks=2)))
        steps.prefill(req)
        steps.decode(req, [7, 8, 9])
        steps.finish(req)
        steps.cache.check_invariants()
    # DEAD is in tree values, never in the free list
    assert steps.alloc.dead_slot not in steps.alloc.free_pages.tolist()
    evict_all(steps)
    steps.cache.check_invariants()
    assert steps.alloc.available_size() == steps.alloc.size - 1
    assert steps.cache.evictable_size() == 0


def test_next_turn_matches_the_sessions_holey_prefix(steps):
    ids = tokens(40, 2)
    pol = StreamingLLM(budget=16, sinks=4)
    t1 = steps.request(ids, payload("s1", pol), rid="t1")
    steps.prefill(t1)
    steps.decode(t1, [11, 12, 13])
    row1 = steps.row(t1).clone()
    steps.finish(t1)

    ids2 = ids + [11, 12, 13] + tokens(10, 3)
    t2 = steps.request(ids2, payload("s1", pol), rid="t2")
    steps.prefill(t2, plan=False)
    got = t2.prefix_indices
    assert len(got) == 43
    assert torch.equal(got, row1)  # holes and slots exactly as turn 1 left them
    dead = steps.alloc.dead_slot
    assert (got[4:28] == dead).all() and not (got[:4] == dead).any()
    live = torch.nonzero(got != dead).reshape(-1)
    k = steps.kv.get_key_buffer(0)[got[live]]
    assert torch.equal(k, steps.kv_value(torch.tensor(ids2)[live], live))
    steps.finish(t2)
    steps.cache.check_invariants()


def test_another_session_never_sees_the_holes(steps):
    ids = tokens(40, 4)
    pol = StreamingLLM(budget=16, sinks=4)
    a = steps.request(ids + [1], payload("a", pol), rid="a")
    steps.prefill(a, chunk=16)  # chunks go to the shared namespace while intact
    steps.finish(a)
    b = steps.request(ids + [2], payload("b", pol), rid="b")
    steps.prefill(b, plan=False)
    assert len(b.prefix_indices) >= 32  # the intact chunks of a
    assert not (b.prefix_indices == steps.alloc.dead_slot).any()
    steps.finish(b)
    # no session at all: the same
    c = steps.request(ids + [3])
    steps.prefill(c, plan=False)
    assert not (c.prefix_indices == steps.alloc.dead_slot).any()
    steps.finish(c)
    steps.cache.check_invariants()


def test_tenants_share_nothing(steps):
    ids = tokens(30, 5)
    a = steps.request(ids, payload("s"), extra_key="tenant-a")
    steps.prefill(a)
    steps.finish(a)
    b = steps.request(ids, payload("s"), extra_key="tenant-b")
    steps.prefill(b, plan=False)
    assert len(b.prefix_indices) == 0
    steps.finish(b)
    c = steps.request(ids, payload("s"), extra_key="tenant-a")
    steps.prefill(c, plan=False)
    assert len(c.prefix_indices) == 29
    steps.finish(c)


def test_eviction_inside_the_matched_prefix_keeps_the_trees_slots(steps):
    """Positions reused from the tree belong to it: evicting them redirects this request only."""
    ids = tokens(40, 6)
    first = steps.request(ids + [5], payload("x"), rid="x")  # FullCache: caches ids intact
    steps.prefill(first)
    steps.finish(first)
    shared = steps.cache.match_prefix(
        MatchPrefixParams(key=RadixKey(first.origin_input_ids, None))
    ).device_indices.clone()
    r = steps.request(ids + [6], payload("y", StreamingLLM(budget=8, sinks=2)), rid="y")
    free0 = steps.alloc.available_size()
    steps.prefill(r, plan=False)
    assert len(r.prefix_indices) == 40
    from agentkv.integrations.sglang.request_plan import request_state
    from agentkv.integrations.sglang.runtime import plan_one

    plan_one(steps.planner, steps.r2t, steps.alloc, r, request_state(r))
    steps.cache.cache_unfinished_req(r)  # SGLang's post-prefill insert
    # 41 positions, keep 8: 33 DEAD, all but one inside the tree's prefix: 1 own slot allocated,
    # and it is kept (the most recent), so nothing is freed
    assert (steps.row(r) == steps.alloc.dead_slot).sum() == 33
    assert steps.alloc.available_size() == free0 - 1
    steps.finish(r)
    again = steps.request(ids + [7], payload("z"), rid="z")
    steps.prefill(again, plan=False)
    assert torch.equal(again.prefix_indices[:40], shared[:40])
    steps.finish(again)
    steps.cache.check_invariants()


def test_retracted_request_is_planned_again(steps):
    from agentkv.integrations.sglang.request_plan import request_state

    req = steps.request(tokens(30, 7), payload("r", StreamingLLM(budget=10, sinks=2)))
    steps.prefill(req)
    assert request_state(req).planned
    steps.finish(req, insert=False)  # retraction / abort: release without caching
    assert not request_state(req).planned
    steps.cache.check_invariants()
    evict_all(steps)
    assert steps.alloc.available_size() == steps.alloc.size - 1


def test_a_retraction_drops_what_the_observer_saw(steps):
    """A request retracted before its plan (mid chunked prefill) is computed again from its
    prompt's start: it gets a fresh observer then, so the rows its first observer saw do not
    count twice."""
    from agentkv.integrations.sglang.request_plan import request_state

    req = steps.request(tokens(30, 8), payload("r", StreamingLLM(budget=10, sinks=2)))
    steps.prefill(req, plan=False)
    state = request_state(req)
    state.observer = object()  # fed the rows computed so far
    steps.finish(req, insert=False)
    assert state.observer is None and not state.planned
    steps.cache.check_invariants()


@pytest.mark.parametrize(
    "strict,evicting",
    [(True, True), (False, True), (True, False), (False, False)],
    ids=["strict", "deferred-checks", "fullcache-and-stock-strict", "fullcache-and-stock"],
)
@pytest.mark.parametrize("seed", [0])
def test_randomised_1000_requests_with_sessions_and_evictions(
    seed, strict, evicting, steps_factory
):
    """1,000 requests: 2 tenants, sessions of growing turns, FullCache / StreamingLLM at random
    budgets, chunked and whole prefills, decodes, aborts, up to 3 in flight, a pool small
    enough that the LRU evicts. Every reference recounted as it goes; at the end every slot
    but DEAD is free again. Frees are settled lazily either way; ``strict=False`` (a
    server's setting) also leaves the fault checks to the settles. Without evicting policies
    (FullCache and requests without payload) no session namespace appears and the tree's own
    counters give the evictable / protected sizes: recounted against the references too."""
    g = random.Random(seed)
    st = steps_factory(size=1200, rows=8, ctx=512)
    st.alloc.strict = strict
    total = st.alloc.available_size()
    sessions: dict[str, list[int]] = {}
    inflight: list[tuple[object, str]] = []
    done = holey_hits = 0
    lru = {"freed": 0}
    evict = st.cache.evict

    def counting_evict(params):
        result = evict(params)
        lru["freed"] += result.num_tokens_evicted
        return result

    st.cache.evict = counting_evict
    while done < 1000:
        if len(inflight) < 3 and g.random() < 0.6:
            tenant = g.choice(["t0", "t1"])
            free_sessions = [
                s for s in sessions if s.startswith(tenant) and all(s != x for _, x in inflight)
            ]
            if free_sessions and g.random() < 0.7:
                sid = g.choice(free_sessions)
            else:
                sid = f"{tenant}-{g.randrange(10**6)}"
                sessions[sid] = tokens(g.randrange(20, 60), g.randrange(10**6))
            prompt = sessions[sid] + tokens(g.randrange(3, 30), g.randrange(10**6))
            if len(prompt) > 400:
                sessions.pop(sid)
                continue
            policy = (
                FullCache()
                if g.random() < 0.3 or not evicting
                else StreamingLLM(budget=g.randrange(8, 64), sinks=g.randrange(0, 4))
            )
            pl = None if not evicting and g.random() < 0.5 else payload(sid, policy)
            req = st.request(prompt, pl, extra_key=tenant, rid=f"q{done}")
            st.prefill(req, chunk=g.choice([None, 8, 32]))
            holey_hits += bool((req.prefix_indices == st.alloc.dead_slot).any())
            inflight.append((req, sid))
        elif inflight:
            req, sid = inflight.pop(g.randrange(len(inflight)))
            out = tokens(g.randrange(0, 12), g.randrange(10**6))
            st.decode(req, out)
            insert = g.random() > 0.05
            st.finish(req, insert=insert)
            if insert and sid in sessions:
                sessions[sid] = list(req.origin_input_ids) + out
            done += 1
            if done % 50 == 0:
                st.cache.check_invariants()
    for req, _ in inflight:
        st.finish(req)
    st.cache.check_invariants()
    # SGLang's idle check: every slot is free, evictable or protected (DEAD)
    a = st.alloc
    assert a.available_size() + st.cache.evictable_size() + st.cache.protected_size() == a.size
    if evicting:
        assert holey_hits > 50, "sessions should reuse their holey prefixes"
    else:
        assert holey_hits == 0 and st.cache.session_tokens == 0
    assert lru["freed"] > 1000, "the pool should be small enough for LRU eviction"
    evict_all(st)
    st.cache.check_invariants()
    assert st.alloc.available_size() == total
    assert st.alloc.dead_slot not in st.alloc.free_pages.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        '{"version": 2, "session_id": "s"}',
        '{"version": 1, "session_id": "s", "policy": {"method": "streamingllm", "budget": 0}}',
        '{"version": 1, "session_id": "s", "policy": {"method": "uniform_quant", "bits": 4}}',
    ],
)
def test_a_payload_the_plugin_cannot_serve_runs_as_stock_sglang(steps, bad):
    """``/generate`` has no HTTP-side check: the scheduler must not fall over."""
    from agentkv.integrations.sglang.request_plan import request_state

    req = steps.request(tokens(30, 8), bad)
    assert request_state(req) is None
    steps.prefill(req)
    assert not (steps.row(req) == steps.alloc.dead_slot).any()
    steps.finish(req)
    steps.cache.check_invariants()
