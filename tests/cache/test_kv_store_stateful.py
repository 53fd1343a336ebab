"""Randomised sequences of requests, turns, evictions, finishes and session ends, with every
store invariant rechecked after every step (hypothesis stateful testing)."""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentkv.cache import DEAD, KVStore, OutOfSlots

from .kv_fill import check_content, fill

L, H, D = 2, 2, 2
SESSIONS = ["s0", "s1", "s2", None]
SYSTEMS = [[60, 61, 62, 63, 64], [60, 61, 70, 71]]  # two system prompts sharing 2 tokens
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=4)  # tiny alphabet: many overlaps


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = KVStore(L, H, D, num_slots=64)
        self.reqs = []
        self.history: dict = {}  # session -> last finished token sequence
        self.known_dead: dict = {}  # request id -> positions evicted so far
        self.session_hits = 0

    # ----------------------------------------------------------------- helpers
    def _extend(self, req, new=None):
        try:
            slots = self.store.extend(req, new)
        except OutOfSlots:
            return False
        fill(self.store, req, slots)
        return True

    def _pick(self, i):
        return self.reqs[i % len(self.reqs)]

    # ------------------------------------------------------------------- rules
    @precondition(lambda self: len(self.reqs) < 3)
    @rule(
        session=st.sampled_from(SESSIONS),
        continue_turn=st.booleans(),
        system=st.sampled_from(SYSTEMS),
        new=tokens,
    )
    def begin(self, session, continue_turn, system, new):
        prev = self.history.get(session)
        prompt = (prev if continue_turn and prev else system) + new
        req = self.store.begin_request(session, prompt)
        assert req.num_cached <= len(prompt) - 1
        assert bool((req.slot_map.slots[: req.num_cached] >= 0).all())
        if not self._extend(req):
            self.store.finish_request(req, cache=False)  # admission failed: abort
            return
        self.reqs.append(req)
        self.known_dead[req.request_id] = set(
            torch.nonzero(req.slot_map.slots == DEAD).reshape(-1).tolist()
        )

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), new=tokens)
    def decode(self, i, new):
        req = self._pick(i)
        for t in new:
            if not self._extend(req, [t]):
                break

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), data=st.data())
    def evict_positions(self, i, data):
        req = self._pick(i)
        pos = data.draw(st.lists(st.integers(0, req.seq_len - 1), max_size=4))
        free = self.store.allocator.free_count
        res = self.store.evict(req, pos)
        assert self.store.allocator.free_count == free + res.slots_freed
        self.known_dead[req.request_id] |= set(pos)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), seed=st.integers(0, 2**16), p=st.sampled_from([0.2, 0.6, 0.95]))
    def evict_heads(self, i, seed, p):
        req = self._pick(i)
        g = torch.Generator().manual_seed(seed)
        keep = torch.rand(L, H, req.seq_len, generator=g) > p
        self.store.evict_per_head(req, keep)
        newly = ~keep.any(dim=1).any(dim=0)
        self.known_dead[req.request_id] |= set(torch.nonzero(newly).reshape(-1).tolist())

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), n=st.integers(1, 8))
    def cache_unfinished(self, i, n):
        req = self._pick(i)
        got = self.store.cache_unfinished_request(req, n)
        assert got <= min(n, req.slot_map.intact_prefix_len())

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), cache=st.booleans())
    def finish(self, i, cache):
        req = self._pick(i)
        self.reqs.remove(req)
        if cache:
            self.history[req.session_id] = req.token_ids[: req.seq_len]
        self.store.finish_request(req, cache=cache)
        del self.known_dead[req.request_id]

    @rule(
        session=st.sampled_from(SESSIONS),
        new=tokens,
        decode=tokens,
        seed=st.integers(0, 2**16),
        per_head=st.booleans(),
    )
    def full_turn(self, session, new, decode, seed, per_head):
        """One whole agent turn: continue the session, prefill, decode, evict, finish."""
        prev = self.history.get(session)
        prompt = (prev if prev and len(prev) < 40 else SYSTEMS[seed % 2]) + new
        req = self.store.begin_request(session, prompt)
        if prev and prompt[: len(prev)] == prev and session is not None:
            self.session_hits += req.prefix_from_session
        ok = self._extend(req)
        for t in decode if ok else []:
            ok = ok and self._extend(req, [t])
        if not ok:
            self.store.finish_request(req, cache=False)
            return
        g = torch.Generator().manual_seed(seed)
        if per_head:
            self.store.evict_per_head(req, torch.rand(L, H, req.seq_len, generator=g) > 0.3)
        else:
            self.store.evict(req, torch.nonzero(torch.rand(req.seq_len, generator=g) < 0.3))
        self.store.check_invariants()
        check_content(self.store, req)
        self.history[session] = req.token_ids[: req.seq_len]
        self.store.finish_request(req)

    @rule(
        op=st.sampled_from(["end_s0", "end_s1", "end_s2", "lru", "lru", "flush"]),
        n=st.integers(1, 20),
    )
    def maintenance(self, op, n):
        a = self.store.allocator
        free = a.free_count
        if op.startswith("end_"):
            freed = self.store.end_session(op[4:])
            assert op[4:] not in self.store.prefix_cache.sessions()
        elif op == "lru":
            freed = self.store.evict_prefix_cache(n)
        else:
            freed = self.store.flush_prefix_cache()
            assert self.store.prefix_cache.num_nodes == 0
        assert a.free_count == free + freed

    # -------------------------------------------------------------- invariants
    @invariant()
    def store_invariants(self):
        self.store.check_invariants()  # recounts every reference and lock
        a = self.store.allocator
        assert int(a.refcount()[DEAD]) == 0
        assert bool((a.refcount() >= 0).all())
        assert DEAD not in a.free_slots().tolist()
        assert 0 <= a.free_count <= a.capacity

    @invariant()
    def requests_read_their_own_kv(self):
        for req in self.reqs:
            check_content(self.store, req)
            dead = set(torch.nonzero(req.slot_map.slots == DEAD).reshape(-1).tolist())
            assert self.known_dead[req.request_id] <= dead  # holes never heal

    def teardown(self):
        for req in list(self.reqs):
            self.store.finish_request(req, cache=True)
        for s in SESSIONS[:3]:
            self.store.end_session(s)
        self.store.flush_prefix_cache()
        self.store.check_invariants()
        assert self.store.allocator.free_count == self.store.allocator.capacity


KVStoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_store_stateful = KVStoreMachine.TestCase
