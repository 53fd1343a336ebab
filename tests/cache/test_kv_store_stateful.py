"""Randomised sequences of requests, turns, evictions (per position and per (layer, head)),
precision moves (INT4 cells, INT2 pages), finishes and session ends, with every store
invariant rechecked after every step (hypothesis stateful testing).

Besides ``KVStore.check_invariants`` (which recounts references from scratch), the machine
keeps its own, independent books: references recounted from the request maps and the prefix
tree, every holder's K/V content (bit for bit at full precision, within quantization error
otherwise), holes and quantization that never heal, and free cells of every precision back
at the start after everything ends.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agentkv.cache import DEAD, KVStore, OutOfSlots, Precision

from .kv_fill import check_cached, check_content, fill

L, H, D = 2, 2, 32
C = L * H
SESSIONS = ["s0", "s1", "s2", None]
# a long system prompt (room for an INT2 page) and a short one sharing its first 2 tokens
SYSTEMS = [list(range(60, 104)), [60, 61, 70, 71]]
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=4)  # tiny alphabet: many overlaps
PRECISIONS = [int(p) for p in (Precision.FULL, Precision.INT4, Precision.INT2, Precision.EVICTED)]


def precision_plan(seed: int, grain: str, t: int) -> torch.Tensor:
    """A random int8 precision plan over ``t`` positions, per position / layer / column: one
    base precision per row (FULL, INT4 or INT2, so INT2 pages can fill), a quarter of the
    8-position runs switched to another precision (EVICTED included)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"position": (t,), "layer": (L, 1, t), "column": (L, H, t)}[grain]
    runs = shape[:-1] + ((t + 7) // 8,)
    base = torch.randint(0, 3, shape[:-1] + (1,), generator=g).expand(runs)
    other = torch.randint(0, len(PRECISIONS), runs, generator=g)
    choice = torch.where(torch.rand(runs, generator=g) < 0.25, other, base)
    plan = torch.tensor(PRECISIONS, dtype=torch.int8)[choice]
    return plan.repeat_interleave(8, dim=-1)[..., :t].contiguous()


class KVStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = KVStore(L, H, D, num_slots=192, int4_slots=96, int2_pages=4)
        a = self.store.allocator
        self.start_free = {p: a.free_cells(p).clone() for p in PRECISIONS[:3]}
        self.reqs = []
        self.history: dict = {}  # session -> last finished token sequence
        self.seen: dict = {}  # request id -> precision map [C, T] last seen

    # ----------------------------------------------------------------- helpers
    def _extend(self, req, new=None):
        try:
            cells = self.store.extend(req, new)
        except OutOfSlots:
            return False
        assert not bool((cells == DEAD).any())  # DEAD is never handed out
        assert bool((self.store.layout.precision(cells) == int(Precision.FULL)).all())
        fill(self.store, req, cells)
        return True

    def _pick(self, i):
        return self.reqs[i % len(self.reqs)]

    def _set_precision(self, req, plan, leftover):
        st_ = self.store
        before = req.slot_map.slots.clone()
        free = st_.allocator.free_cells(Precision.FULL)
        cached = st_.prefix_cache.held_cells()
        try:
            res = st_.set_precision(req, plan, int2_leftover=leftover)
        except OutOfSlots:
            assert torch.equal(req.slot_map.slots, before)  # nothing moved
            return
        after = req.slot_map.slots
        changed = after != before
        assert int(changed.sum()) == res.int4 + res.int2
        assert not bool((after[changed] == DEAD).any()) and not bool(
            (before[changed] == DEAD).any()
        )
        was = st_.layout.precision(before[changed])
        now = st_.layout.precision(after[changed])
        assert bool((was == int(Precision.FULL)).all())  # only full cells move
        assert int((now == int(Precision.INT4)).sum()) == res.int4
        assert int((now == int(Precision.INT2)).sum()) == res.int2
        gained = int((st_.allocator.free_cells(Precision.FULL) - free).sum())
        if st_.prefix_cache.held_cells() == cached:
            assert gained == res.slots_freed
        else:  # room in the quantized pools was made by LRU-evicting the prefix cache
            assert gained >= res.slots_freed
        # INT2 cells come in whole pages of one column, in position order
        for c in range(C):
            rows = after[c][changed[c] & (st_.layout.precision(after[c]) == int(Precision.INT2))]
            assert rows.numel() % 32 == 0
            rel = (rows - st_.layout.int2_base).view(-1, 32)
            assert bool((rel % 32 == torch.arange(32)).all())
            assert bool((rel // 32 == rel[:, :1] // 32).all())

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
        prompt = (prev if continue_turn and prev and len(prev) < 60 else system) + new
        req = self.store.begin_request(session, prompt)
        assert req.num_cached <= len(prompt) - 1
        assert req.slot_map.slots.shape == (C, req.num_cached)
        if not self._extend(req):
            self.store.finish_request(req, cache=False)  # admission failed: abort
            return
        self.reqs.append(req)

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
        free = self.store.allocator.free_cells(Precision.FULL).sum()
        res = self.store.evict(req, pos)
        # full cells freed; quantized ones go back to their own lists
        assert self.store.allocator.free_cells(Precision.FULL).sum() - free <= res.slots_freed
        assert bool((req.slot_map.slots[:, pos] == DEAD).all())

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), seed=st.integers(0, 2**16), p=st.sampled_from([0.2, 0.6, 0.95]))
    def evict_heads(self, i, seed, p):
        req = self._pick(i)
        g = torch.Generator().manual_seed(seed)
        keep = torch.rand(L, H, req.seq_len, generator=g) > p
        self.store.evict_per_head(req, keep)
        assert bool((req.slot_map.slots[~keep.view(C, -1)] == DEAD).all())

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), data=st.data())
    def free_one_cell(self, i, data):
        """Evict one (layer, head, position) cell: exactly that column's cell comes back
        (when nothing else holds it) and the request's resident bytes drop by its bytes."""
        st_ = self.store
        req = self._pick(i)
        c = data.draw(st.integers(0, C - 1))
        t = data.draw(st.integers(0, req.seq_len - 1))
        cell = req.slot_map.slots[c, t].clone()
        prec = Precision(int(st_.layout.precision(cell)))
        held = int(st_.allocator.refcount()[c, cell]) if prec != Precision.EVICTED else 0
        free = {p: st_.allocator.free_cells(p) for p in PRECISIONS[:3]}
        before = st_.request_stats(req)
        keep = torch.ones(C, t + 1, dtype=torch.bool)
        keep[c, t] = False
        res = st_.evict_per_head(req, keep)
        after = st_.request_stats(req)
        assert res.entries_evicted == int(prec != Precision.EVICTED)
        if prec == Precision.EVICTED:
            assert after.resident_bytes == before.resident_bytes and res.slots_freed == 0
            return
        lab = prec.label
        assert before.cells_by_precision[lab] - after.cells_by_precision[lab] == 1
        drop = before.resident_bytes - after.resident_bytes  # per-precision sums are rounded
        assert abs(drop - st_.pool.cell_bytes[prec]) <= 1
        others = [p for p in PRECISIONS[:3] if p != int(prec)]
        for p in others:
            assert torch.equal(st_.allocator.free_cells(p), free[p])
        gained = st_.allocator.free_cells(prec) - free[prec]
        if prec == Precision.INT2:
            assert res.slots_freed in (0, 32) and int(gained.sum()) == res.slots_freed // 32
        else:
            want = torch.zeros(C, dtype=torch.int64)
            want[c] = int(held == 1)
            assert torch.equal(gained, want) and res.slots_freed == int(held == 1)
            if held == 1:
                assert st_.allocator.free_ids(c, prec).tolist()[-1] == int(cell)

    @precondition(lambda self: self.reqs)
    @rule(
        i=st.integers(0, 3),
        seed=st.integers(0, 2**16),
        grain=st.sampled_from(["position", "layer", "column"]),
        leftover=st.sampled_from(["int4", "full"]),
        cover=st.sampled_from([0.5, 1.0]),
    )
    def set_precision(self, i, seed, grain, leftover, cover):
        req = self._pick(i)
        t = max(1, int(req.seq_len * cover))
        self._set_precision(req, precision_plan(seed, grain, t), leftover)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), density=st.sampled_from([0.75, 1.0]))
    def compact_int4(self, i, density):
        """Moving a request's sparse INT4 cells changes no precision, no live position and
        no resident byte (the invariants recheck every holder's content and count)."""
        st_ = self.store
        req = self._pick(i)
        req.int4_thinned = True  # look even where this step's evictions did not
        before = req.slot_map.slots.clone()
        used = st_.stats().used_bytes
        res = st_.compact_int4(req, min_density=density)
        after = req.slot_map.slots
        assert int((after != before).sum()) == res.cells_moved
        assert torch.equal(st_.layout.precision(after), st_.layout.precision(before))
        assert st_.stats().used_bytes == used

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), n=st.integers(1, 40))
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
        self.seen.pop(req.request_id, None)

    @rule(
        session=st.sampled_from(SESSIONS),
        new=tokens,
        decode=tokens,
        seed=st.integers(0, 2**16),
        per_head=st.booleans(),
        quantize=st.sampled_from([None, "position", "layer", "column"]),
    )
    def full_turn(self, session, new, decode, seed, per_head, quantize):
        """One whole agent turn: continue the session, prefill, decode, evict, quantize,
        finish."""
        prev = self.history.get(session)
        prompt = (prev if prev and len(prev) < 60 else SYSTEMS[seed % 2]) + new
        req = self.store.begin_request(session, prompt)
        ok = self._extend(req)
        for t in decode if ok else []:
            ok = ok and self._extend(req, [t])
        if not ok:
            self.store.finish_request(req, cache=False)
            return
        g = torch.Generator().manual_seed(seed)
        p = 0.3 if quantize is None else 0.05  # leave room for INT2 pages to fill
        if per_head:
            self.store.evict_per_head(req, torch.rand(L, H, req.seq_len, generator=g) > p)
        else:
            self.store.evict(req, torch.nonzero(torch.rand(req.seq_len, generator=g) < p))
        if quantize is not None:
            self._set_precision(req, precision_plan(seed, quantize, req.seq_len), "int4")
        self.store.check_invariants()
        check_content(self.store, req)
        self.history[session] = req.token_ids[: req.seq_len]
        self.store.finish_request(req)

    @rule(
        op=st.sampled_from(["end_s0", "end_s1", "end_s2", "lru", "lru", "flush"]),
        n=st.integers(1, 200),
    )
    def maintenance(self, op, n):
        a = self.store.allocator
        free = sum(int(a.free_cells(p).sum()) for p in PRECISIONS[:2])
        free += 32 * int(a.free_cells(Precision.INT2).sum())
        if op.startswith("end_"):
            freed = self.store.end_session(op[4:])
            assert op[4:] not in self.store.prefix_cache.sessions()
        elif op == "lru":
            freed = self.store.evict_prefix_cache(n)
        else:
            freed = self.store.flush_prefix_cache()
            assert self.store.prefix_cache.num_nodes == 0
        after = sum(int(a.free_cells(p).sum()) for p in PRECISIONS[:2])
        after += 32 * int(a.free_cells(Precision.INT2).sum())
        assert after == free + freed

    # -------------------------------------------------------------- invariants
    @invariant()
    def store_invariants(self):
        self.store.check_invariants()  # recounts every reference and lock
        a = self.store.allocator
        rc = a.refcount()
        assert bool((rc[:, DEAD] == 0).all()) and bool((rc >= 0).all())
        assert 0 <= a.free_count <= a.capacity

    @invariant()
    def independent_reference_count(self):
        """References recounted here from the request maps and prefix-tree nodes; no cell at
        two positions; no referenced cell on a free list; DEAD on no free list."""
        st_ = self.store
        lay = st_.layout
        counts = torch.zeros(C, lay.num_ids, dtype=torch.int32)
        where = torch.full((C, lay.num_ids), -1, dtype=torch.int64)
        holders = [(r.slot_map.slots, 0) for r in self.reqs]
        holders += [(n.value, start) for _, start, n in st_.prefix_cache.iter_nodes()]
        for cells, start in holders:
            pos = torch.arange(start, start + cells.shape[1]).expand_as(cells)
            cols = torch.arange(C)[:, None].expand_as(cells)
            live = cells != DEAD
            counts.index_put_((cols[live], cells[live]), torch.ones(1, dtype=torch.int32), True)
            prev = where[cols[live], cells[live]]
            assert bool(((prev == -1) | (prev == pos[live])).all()), "a cell at two positions"
            where[cols[live], cells[live]] = pos[live]
        assert torch.equal(counts, st_.allocator.refcount())
        for c in range(C):
            for p in (Precision.FULL, Precision.INT4):
                free = st_.allocator.free_ids(c, p)
                assert DEAD not in free.tolist()
                assert not bool((counts[c, free] > 0).any()), "a held cell on a free list"
            pages = st_.allocator.free_ids(c, Precision.INT2)
            rows = lay.int2_base + pages[:, None] * 32 + torch.arange(32)
            assert not bool((counts[c, rows] > 0).any()), "a held INT2 page on a free list"

    @invariant()
    def everyone_reads_their_own_kv(self):
        for req in self.reqs:
            check_content(self.store, req)
        check_cached(self.store)  # shared nodes bit for bit, whatever siblings did

    @invariant()
    def holes_and_quantization_never_heal(self):
        for req in self.reqs:
            now = self.store.layout.precision(req.slot_map.slots)
            old = self.seen.get(req.request_id)
            if old is not None:
                assert bool((now[:, : old.shape[1]] <= old).all())
            self.seen[req.request_id] = now

    def teardown(self):
        for req in list(self.reqs):
            self.store.finish_request(req, cache=True)
        for s in SESSIONS[:3]:
            self.store.end_session(s)
        self.store.flush_prefix_cache()
        self.store.check_invariants()
        a = self.store.allocator
        for p, free in self.start_free.items():
            assert torch.equal(a.free_cells(p), free)
        assert bool((a.refcount() == 0).all())
        assert self.store.stats().used_bytes == 0


KVStoreMachine.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_store_stateful = KVStoreMachine.TestCase
