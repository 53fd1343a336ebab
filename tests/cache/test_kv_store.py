import pytest
import torch

from agentkv.cache import DEAD, KVStore, OutOfSlots, Precision, SlotRefcountError
from agentkv.kernels import INT2_PAGE

from .kv_fill import check_content, fill, kv_value

L, H, D = 2, 2, 32
C = L * H
P4, P2 = int(Precision.INT4), int(Precision.INT2)


def store(num_slots=64, **kw):
    return KVStore(L, H, D, num_slots, **kw)


def run(st, session, tokens, decode=()):
    """begin + prefill (+ decode) with content written; returns the request."""
    req = st.begin_request(session, tokens)
    fill(st, req, st.extend(req))
    for t in decode:
        fill(st, req, st.extend(req, [t]))
    return req


def drained(st, sessions=()):
    """End ``sessions``, flush the prefix cache: every cell of every precision is free."""
    for s in sessions:
        st.end_session(s)
    st.flush_prefix_cache()
    st.check_invariants()
    a = st.allocator
    lay = st.layout
    assert a.free_cells(Precision.FULL).tolist() == [lay.full_slots - 1] * C
    assert a.free_cells(Precision.INT4).tolist() == [lay.int4_slots] * C
    assert a.free_cells(Precision.INT2).tolist() == [lay.int2_pages] * C
    s = st.stats()
    assert s.free_slots == s.capacity and s.used_bytes == 0
    assert bool((a.refcount() == 0).all())


def cells_of(st, req, precision):
    return int((st.layout.precision(req.slot_map.slots) == int(precision)).sum())


def test_default_layout_and_dead_constant():
    st = store()
    assert (st.layout.full_slots, st.layout.int4_slots, st.layout.int2_pages) == (64, 64, 2)
    pools = pytest.importorskip("agentkv.kernels.pools")
    assert pools.DEAD == DEAD
    lay0 = st.pool.layers[0]
    assert (lay0.int4_base, lay0.int2_base) == (st.layout.int4_base, st.layout.int2_base)
    # a head_dim the quantizers cannot take gets no quantized pools
    plain = KVStore(L, H, 4, 16)
    assert (plain.layout.int4_slots, plain.layout.int2_pages) == (0, 0)


def test_request_lifecycle_and_prefix_hit():
    st = store()
    r1 = run(st, "A", [1, 2, 3, 4], decode=[5, 6])
    assert r1.num_cached == 0 and r1.seq_len == 6 and r1.token_ids == [1, 2, 3, 4, 5, 6]
    assert r1.slot_map.slots.shape == (C, 6)
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
    with pytest.raises(RuntimeError):
        st.extend(r2, [1])
    drained(st)


def test_last_prompt_token_is_always_computed():
    st = store()
    st.finish_request(run(st, None, [1, 2, 3]))
    r = st.begin_request(None, [1, 2, 3])
    assert r.num_cached == 2 and r.num_pending == 1
    assert st.extend(r).shape == (C, 1)
    assert st.extend(r).shape == (C, 0)  # nothing pending
    st.finish_request(r, cache=False)
    with pytest.raises(ValueError):
        st.begin_request(None, [])
    drained(st)


def test_truncate_undoes_the_last_decode_steps_as_if_never_extended():
    """A step launched ahead of a token that turned out to be a stop: its position goes,
    cells back to the pool, token id gone; the request is one never extended that far."""
    st = store()
    st.finish_request(run(st, "a", list(range(10))))
    used = st.stats().used_slots
    req = run(st, "b", list(range(10)), decode=[100, 101, 102, 103])
    assert req.num_cached == 9  # (its prompt from a's prefix cache, the last one computed)
    released = st.truncate(req, 2)
    assert (released.positions_dead, released.entries_evicted, released.slots_freed) == (
        2,
        2 * C,
        2 * C,
    )
    assert req.seq_len == 12 and req.token_ids == [*range(10), 100, 101]
    assert st.stats().used_slots == used + 3  # (the last prompt position and 2 decoded)
    st.check_invariants()
    check_content(st, req)
    with pytest.raises(ValueError, match="can drop 0..3 computed positions"):
        st.truncate(req, 4)  # (into the prefix-cache match, shared)
    req.token_ids.append(7)
    with pytest.raises(ValueError, match="pending tokens"):
        st.truncate(req, 1)
    req.token_ids.pop()
    st.finish_request(req)
    again = run(st, "c", [*range(10), 100, 101, 5])
    assert again.num_cached == 12  # (b's prefix cache entry ends where it was cut)
    st.finish_request(again)
    drained(st, ["a", "b", "c"])


def test_sibling_requests_share_prefix_and_eviction_in_one_frees_nothing():
    st = store()
    st.finish_request(run(st, "S", [9, 8, 7, 6, 5]))
    a = run(st, "A", [9, 8, 7, 6, 5, 1])
    b = run(st, "B", [9, 8, 7, 6, 5, 2])
    used = st.stats().used_bytes
    res = st.evict(a, [0, 1, 2])  # inside the prefix-cache-protected prefix
    assert res.positions_dead == 3 and res.entries_evicted == 3 * C and res.slots_freed == 0
    assert st.stats().used_bytes == used
    res = st.evict(a, [5])  # a's own, unshared position: one cell per column
    assert res.positions_dead == 1 and res.slots_freed == C
    check_content(st, a)
    check_content(st, b)  # b still reads the original cells and K/V
    assert b.slot_map.num_dead == 0
    st.check_invariants()
    for r in (a, b):
        st.finish_request(r)
    drained(st, ["A", "B", "S"])


def test_per_head_eviction_over_a_window_equals_it_over_the_whole_map():
    """A decode-time pass hands ``evict_per_head`` only its window (``start``): the same
    cells go, the same counts and released cells as with a mask over every position."""
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(L, H, 5, generator=g) > 0.5
    got, want = store(), store()
    r1, r2 = run(got, None, list(range(1, 11))), run(want, None, list(range(1, 11)))
    full = torch.ones(L, H, 10, dtype=torch.bool)
    full[:, :, 3:8] = keep
    a, b = got.evict_per_head(r1, keep, start=3), want.evict_per_head(r2, full)
    assert (a.entries_evicted, a.positions_dead, a.slots_freed) == (
        b.entries_evicted,
        b.positions_dead,
        b.slots_freed,
    )
    assert a.entries_evicted == int((~keep).sum()) > 0
    assert torch.equal(a.released, b.released[:, 3:8])
    assert torch.equal(r1.slot_map.slots, r2.slot_map.slots)
    with pytest.raises(ValueError, match="covers positions 8..12"):
        got.evict_per_head(r1, keep, start=8)


def test_per_head_eviction_frees_exactly_that_columns_cell():
    st = store()
    r = run(st, None, [1, 2, 3, 4])
    cb = st.pool.cell_bytes[Precision.FULL]
    before = st.request_stats(r)
    free_before = st.allocator.free_cells(Precision.FULL)
    cell = int(r.slot_map.slots[1, 1])  # layer 0, head 1, position 1
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[0, 1, 1] = False
    res = st.evict_per_head(r, keep)
    assert (res.entries_evicted, res.positions_dead, res.slots_freed) == (1, 0, 1)
    free = st.allocator.free_cells(Precision.FULL)
    assert (free - free_before).tolist() == [0, 1, 0, 0]  # only column 1 got a cell back
    assert st.allocator.free_ids(1, Precision.FULL).tolist()[-1] == cell
    after = st.request_stats(r)
    assert before.resident_bytes - after.resident_bytes == cb
    assert st.stats().used_bytes == after.resident_bytes  # nobody else holds anything
    keep[:, :, 1] = False
    res = st.evict_per_head(r, keep)
    assert (res.entries_evicted, res.positions_dead, res.slots_freed) == (C - 1, 1, C - 1)
    rs = st.request_stats(r)
    assert rs.resident_slots == 3 and rs.dead_positions == 1
    assert rs.live_kv_entries == 3 * C
    assert rs.resident_bytes == 3 * st.pool.bytes_per_token == rs.effective_bytes
    assert rs.resident_bytes_by_precision == {"full": 3 * C * cb, "int4": 0, "int2": 0}
    assert rs.slot_map_bytes == 8 * C * 4
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[1, 1, 2] = False
    st.evict_per_head(r, keep)
    assert st.request_stats(r).effective_live_tokens == pytest.approx(3 - 1 / C)
    check_content(st, r)
    k, _, pos, hm = st.read_kv(r, 1)
    assert pos.tolist() == [0, 2, 3] and hm.tolist() == [[True] * 3, [True, False, True]]
    assert bool((k[1, 1] == 0).all())  # the dead head reads zeros
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_extend_evicts_lru_prefix_cache_then_raises_out_of_slots():
    st = store(num_slots=9)  # 8 usable per column
    st.finish_request(run(st, None, [1, 2, 3, 4]))
    st.finish_request(run(st, None, [5, 6, 7]))
    assert st.stats().free_slots == 1
    r = run(st, None, [10, 11, 12, 13, 14])  # needs 5: evicts the LRU entry [1, 2, 3, 4]
    assert st.prefix_cache.match(None, torch.tensor([1, 2])).length == 0
    assert st.prefix_cache.match(None, torch.tensor([5, 6])).length == 2
    with pytest.raises(OutOfSlots, match="need 4 KV cells"):
        st.extend(r, [1, 2, 3, 4])
    assert r.seq_len == 5 and len(r.token_ids) == 5  # unchanged
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_per_head_frees_make_room_only_in_their_column():
    """Extending needs a free cell in every column: a column full elsewhere still blocks."""
    st = store(num_slots=5)  # 4 usable per column
    r = run(st, None, [1, 2, 3, 4])
    keep = torch.ones(L, H, 4, dtype=torch.bool)
    keep[0, 0, :2] = False  # two cells of column 0 only
    st.evict_per_head(r, keep)
    assert st.allocator.free_cells(Precision.FULL).tolist() == [2, 0, 0, 0]
    with pytest.raises(OutOfSlots):
        st.extend(r, [5])
    st.evict(r, [0])
    fill(st, r, st.extend(r, [5]))
    check_content(st, r)
    st.finish_request(r, cache=False)
    drained(st)


def test_locked_prefix_is_not_evicted_under_pressure():
    st = store(num_slots=9)
    st.finish_request(run(st, None, [1, 2, 3, 4]))
    r = run(st, None, [1, 2, 3, 4, 5])  # locks [1, 2, 3, 4]
    with pytest.raises(OutOfSlots):
        st.extend(r, [0] * 4)
    assert st.prefix_cache.match(None, torch.tensor([1, 2, 3, 4])).length == 4
    st.finish_request(r)
    drained(st)


def test_cache_unfinished_request_shares_system_prompt_before_own_eviction():
    st = store()
    system = [50, 51, 52, 53]
    a = run(st, "A", system + [1, 2])
    assert st.cache_unfinished_request(a, num_tokens=len(system)) == 4
    st.evict(a, [1, 2, 5])  # evicts inside the just-published prompt: memory stays
    st.set_precision(a, torch.full((4,), P4, dtype=torch.int8))  # and quantizes the rest
    assert st.cache_unfinished_request(a) == 0  # nothing intact left to publish
    b = st.begin_request("B", system + [3])
    assert b.num_cached == 4 and b.slot_map.num_dead == 0
    assert torch.equal(b.slot_map.slots, st.prefix_cache.match(None, torch.tensor(system)).slots)
    assert cells_of(st, b, Precision.FULL) == 4 * C
    fill(st, b, st.extend(b))
    check_content(st, a)
    check_content(st, b)
    st.check_invariants()
    for r in (a, b):
        st.finish_request(r)
    st.check_invariants()
    drained(st, ["A", "B"])


def test_refcount_errors_surface():
    st = store()
    r = run(st, None, [1, 2])
    one = torch.full_like(r.slot_map.slots[:, :1], DEAD)
    one[2, 0] = r.slot_map.slots[2, 0]
    st.allocator.decref(one)  # someone else drops the map's reference by mistake...
    with pytest.raises(SlotRefcountError, match="refcount mismatch"):
        st.check_invariants()
    with pytest.raises(SlotRefcountError, match="double free"):
        st.allocator.decref(one)


def test_check_invariants_catches_a_cell_at_two_positions():
    st = store()
    r = run(st, None, [1, 2, 3])
    st.allocator.incref(r.slot_map.slots[:, :1])
    r.slot_map._slots[0, 2] = r.slot_map._slots[0, 0]  # the same cell at positions 0 and 2
    with pytest.raises(SlotRefcountError):
        st.check_invariants()


def test_stats_fields():
    st = store()
    r = run(st, "A", [1, 2, 3])
    s = st.stats()
    assert (s.capacity, s.used_slots, s.free_slots) == (63, 3, 60)
    assert s.used_bytes == 3 * s.bytes_per_token == s.used_bytes_by_precision["full"]
    assert s.bytes_per_token == C * 2 * D * 4
    assert s.pool_bytes == st.pool.total_bytes > 64 * s.bytes_per_token
    assert s.num_requests == 1 and s.requests_resident_slots == 3
    assert s.requests_effective_live_tokens == 3
    st.evict(r, [1])
    st.finish_request(r)
    s = st.stats()
    assert s.num_requests == 0 and s.num_sessions == 1 and s.prefix_cache_tokens == 1 + 3
    assert s.prefix_cache_nodes == 2
    for c in range(C):
        assert DEAD not in st.allocator.free_ids(c, Precision.FULL).tolist()
    drained(st, ["A"])


def test_request_without_session_shares_only_its_intact_prefix():
    st = store()
    r = run(st, None, [1, 2, 3, 4, 5], decode=[6])
    st.evict(r, [3])
    st.finish_request(r)
    assert st.stats().num_sessions == 0
    r2 = st.begin_request(None, [1, 2, 3, 4, 5, 6, 7])
    assert r2.num_cached == 3 and r2.slot_map.num_dead == 0  # holes never leak to others
    st.finish_request(r2, cache=False)
    drained(st)


def test_one_head_evicted_ends_the_shared_prefix():
    st = store()
    r = run(st, None, [1, 2, 3, 4, 5])
    keep = torch.ones(L, H, 5, dtype=torch.bool)
    keep[1, 0, 2] = False
    st.evict_per_head(r, keep)
    st.finish_request(r)
    r2 = st.begin_request("X", [1, 2, 3, 4, 5, 6])
    assert r2.num_cached == 2 and r2.slot_map.live_entries() == 2 * C
    st.finish_request(r2, cache=False)
    drained(st)


def test_evict_per_head_plan_may_cover_a_prefix_of_the_sequence():
    st = store()
    r = run(st, "A", [1, 2, 3], decode=[4, 5])
    keep = torch.zeros(L, H, 3, dtype=torch.bool)  # plan made at prefill time
    res = st.evict_per_head(r, keep)
    assert res.positions_dead == 3 and r.slot_map.slots[:, 3:].ne(DEAD).all()
    with pytest.raises(ValueError):
        st.evict_per_head(r, torch.ones(L, H, 6, dtype=torch.bool))
    st.finish_request(r, cache=False)
    drained(st)


def test_end_session_while_a_request_runs_keeps_its_kv():
    st = store()
    a1 = run(st, "A", [1, 2, 3, 4])
    st.evict(a1, [1])
    st.set_precision(a1, torch.tensor([P4, P4, 16, 16], dtype=torch.int8))
    st.finish_request(a1)
    a2 = st.begin_request("A", [1, 2, 3, 4, 5])
    assert a2.prefix_from_session and cells_of(st, a2, Precision.INT4) == C
    fill(st, a2, st.extend(a2))
    st.end_session("A")
    check_content(st, a2)  # the request's own references keep its cells
    st.check_invariants()
    st.finish_request(a2)  # re-creates A's namespace with its holes
    assert st.prefix_cache.sessions() == ["A"]
    drained(st, ["A"])


# ------------------------------------------------------------------ precision moves
def test_set_precision_int4_moves_cells_and_frees_full_ones():
    st = store()
    r = run(st, None, list(range(1, 9)))
    cb = st.pool.cell_bytes
    prec = torch.full((6,), P4, dtype=torch.int8)
    prec[2] = int(Precision.FULL)
    prec[3] = int(Precision.EVICTED)  # EVICTED leaves a cell alone: evict first
    res = st.set_precision(r, prec)
    assert (res.int4, res.int2, res.slots_freed) == (4 * C, 0, 4 * C)
    pr = st.layout.precision(r.slot_map.slots)
    assert bool((pr[:, [0, 1, 4, 5]] == P4).all()) and bool((pr[:, [2, 3, 6, 7]] == 16).all())
    rs = st.request_stats(r)
    assert rs.cells_by_precision == {"full": 4 * C, "int4": 4 * C, "int2": 0}
    assert rs.resident_bytes_by_precision["int4"] == round(4 * C * cb[Precision.INT4])
    assert rs.resident_bytes == round(4 * C * (cb[Precision.FULL] + cb[Precision.INT4]))
    assert rs.effective_bytes == 8 * st.pool.bytes_per_token  # live KV as if full
    assert rs.live_kv_entries == 8 * C
    assert st.stats().used_bytes == rs.resident_bytes
    assert st.allocator.free_cells(Precision.FULL).tolist() == [63 - 4] * C
    check_content(st, r)
    # quantized cells never move back or again; a second call is a no-op for them
    assert st.set_precision(r, prec).int4 == 0
    assert st.set_precision(r, torch.full((2,), P2, dtype=torch.int8)).int2 == 0
    assert st.set_precision(r, torch.full((8,), 16, dtype=torch.int8)).int4 == 0
    with pytest.raises(ValueError, match="covers positions 0..8 but the request has 8"):
        st.set_precision(r, torch.full((9,), P4, dtype=torch.int8))
    with pytest.raises(ValueError, match="covers positions 5..8"):
        st.set_precision(r, torch.full((4,), P4, dtype=torch.int8), start=5)
    with pytest.raises(ValueError, match="covers positions -1..0"):
        st.set_precision(r, torch.full((2,), P4, dtype=torch.int8), start=-1)
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_set_precision_per_layer_and_per_head():
    st = store()
    r = run(st, None, list(range(1, 7)))
    per_layer = torch.tensor([16, P4], dtype=torch.int8).view(L, 1, 1).expand(L, 1, 6)
    st.set_precision(r, per_layer)
    pr = st.layout.precision(r.slot_map.slots).view(L, H, 6)
    assert bool((pr[0] == 16).all()) and bool((pr[1] == P4).all())
    per_head = torch.full((L, H, 3), 16, dtype=torch.int8)
    per_head[0, 1] = P4  # one (layer, head) column, first 3 positions
    free_before = st.allocator.free_cells(Precision.FULL)
    res = st.set_precision(r, per_head)
    assert (res.int4, res.slots_freed) == (3, 3)
    gained = st.allocator.free_cells(Precision.FULL) - free_before
    assert gained.tolist() == [0, 3, 0, 0]  # that column's full cells, nobody else's
    check_content(st, r)
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


@pytest.mark.parametrize("leftover", ["int4", "full"])
def test_set_precision_on_a_window_equals_the_call_with_full_before_it(leftover):
    """``start``: precision for positions ``start ..`` only (a decode-time page) does what
    the call over every position with FULL before the window does: same cells, same
    values, same free lists, per-head holes and INT2 leftovers included."""
    g = torch.Generator().manual_seed(1)
    n, start = 3 * INT2_PAGE + 7, INT2_PAGE + 3
    u = torch.rand(L, H, n - start, generator=g)
    window = torch.where(u < 0.15, 16, torch.where(u < 0.3, P4, P2)).to(torch.int8)
    keep = torch.rand(L, H, n, generator=g) > 0.1  # per-head holes in the window too
    stores = []
    for windowed in (True, False):
        st = store(num_slots=256)
        r = run(st, None, [i % 50 + 1 for i in range(n + 2)])
        st.evict_per_head(r, keep)
        if windowed:
            res = st.set_precision(r, window, int2_leftover=leftover, start=start)
        else:
            pre = torch.full((L, H, start), 16, dtype=torch.int8)
            res = st.set_precision(r, torch.cat([pre, window], dim=2), int2_leftover=leftover)
        check_content(st, r)
        st.check_invariants()
        stores.append((st, r, res))
    (a, ra, resa), (b, rb, resb) = stores
    assert resa == resb and resa.int4 > 0 and resa.int2 > 0
    assert torch.equal(ra.slot_map.slots, rb.slot_map.slots)
    for p in (Precision.FULL, Precision.INT4, Precision.INT2):
        assert torch.equal(a.allocator.free_cells(p), b.allocator.free_cells(p))
    for name, t in vars(a.pool.stack).items():
        assert t is None or torch.equal(t, getattr(b.pool.stack, name)), name


def test_set_precision_int2_fills_pages_of_32_per_column_leftovers_to_int4():
    st = store(num_slots=128)  # 4 INT2 pages per column
    n = 2 * INT2_PAGE + 5  # 69 positions: 2 pages + 5 leftovers per column
    r = run(st, None, [i % 50 + 1 for i in range(n + 3)])
    res = st.set_precision(r, torch.full((n,), P2, dtype=torch.int8))
    assert (res.int2, res.int4, res.slots_freed) == (2 * INT2_PAGE * C, 5 * C, n * C)
    lay = st.layout
    pr = lay.precision(r.slot_map.slots)
    assert bool((pr[:, : 2 * INT2_PAGE] == P2).all())
    assert bool((pr[:, 2 * INT2_PAGE : n] == P4).all())  # the last 5 did not fill a page
    assert bool((pr[:, n:] == 16).all())
    for c in range(C):  # each page: 32 consecutive positions of one column, rows in order
        rows = r.slot_map.slots[c, : 2 * INT2_PAGE].view(2, INT2_PAGE) - lay.int2_base
        assert bool((rows // INT2_PAGE == rows[:, :1] // INT2_PAGE).all())
        assert bool((rows % INT2_PAGE == torch.arange(INT2_PAGE)).all())
    assert st.allocator.free_cells(Precision.INT2).tolist() == [2] * C
    rs = st.request_stats(r)
    assert rs.cells_by_precision == {"full": 3 * C, "int4": 5 * C, "int2": 64 * C}
    cb = st.pool.cell_bytes
    assert rs.resident_bytes_by_precision["int2"] == round(64 * C * cb[Precision.INT2])
    assert rs.resident_bytes < 0.25 * rs.effective_bytes
    check_content(st, r)
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_set_precision_int2_leftovers_can_stay_full_until_a_page_fills():
    st = store()
    r = run(st, None, list(range(1, 21)))
    res = st.set_precision(r, torch.full((20,), P2, dtype=torch.int8), int2_leftover="full")
    assert (res.int2, res.int4, res.slots_freed) == (0, 0, 0)  # no page fills yet
    for t in range(12):  # decode to 32 positions
        fill(st, r, st.extend(r, [100 + t]))
    res = st.set_precision(r, torch.full((32,), P2, dtype=torch.int8), int2_leftover="full")
    assert (res.int2, res.int4) == (INT2_PAGE * C, 0)
    assert bool((st.layout.precision(r.slot_map.slots) == P2).all())
    check_content(st, r)
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_int2_pages_count_only_the_positions_bound_for_int2_in_each_column():
    """Per-column page filling: a column with a hole takes its 32 INT2 rows further on."""
    st = store()
    r = run(st, None, list(range(1, 41)))
    keep = torch.ones(L, H, 40, dtype=torch.bool)
    keep[1, 0, 3] = False  # column 2 loses position 3
    st.evict_per_head(r, keep)
    st.set_precision(r, torch.full((33,), P2, dtype=torch.int8))
    pr = st.layout.precision(r.slot_map.slots)
    assert bool((pr[[0, 1, 3], :32] == P2).all()) and bool((pr[[0, 1, 3], 32] == P4).all())
    assert int(pr[2, 3]) == 0 and bool((pr[2, :33][torch.arange(33) != 3] == P2).all())
    check_content(st, r)
    # evicting one INT2 row drops the request's bytes, the page stays until all 32 go
    free2 = st.allocator.free_cells(Precision.INT2)
    before = st.request_stats(r).resident_bytes
    keep = torch.ones(L, H, 1, dtype=torch.bool)
    keep[0, 0, 0] = False
    res = st.evict_per_head(r, keep)
    assert res.slots_freed == 0 and torch.equal(st.allocator.free_cells(Precision.INT2), free2)
    assert before - st.request_stats(r).resident_bytes == round(st.pool.cell_bytes[Precision.INT2])
    keep = torch.ones(L, H, 32, dtype=torch.bool)
    keep[0, 0] = False
    assert st.evict_per_head(r, keep).slots_freed == INT2_PAGE
    assert (st.allocator.free_cells(Precision.INT2) - free2).tolist() == [1, 0, 0, 0]
    st.check_invariants()
    st.finish_request(r, cache=False)
    drained(st)


def test_quantized_pools_full_evict_prefix_cache_then_raise():
    st = store(num_slots=16, int4_slots=4, int2_pages=0)
    a = run(st, "S", [1, 2, 3, 4, 5, 6])
    st.set_precision(a, torch.full((4,), P4, dtype=torch.int8))
    st.finish_request(a)  # its INT4 cells now live in S's namespace
    assert st.prefix_cache.sessions() == ["S"]
    assert st.allocator.free_cells(Precision.INT4).tolist() == [0] * C
    b = run(st, None, list(range(7, 15)))
    st.set_precision(b, torch.full((2,), P4, dtype=torch.int8))  # LRU-evicts S's namespace
    assert st.prefix_cache.sessions() == []
    assert cells_of(st, b, Precision.INT4) == 2 * C
    before = b.slot_map.slots.clone()
    with pytest.raises(OutOfSlots, match="quantized pools are full"):
        st.set_precision(b, torch.full((8,), P4, dtype=torch.int8))  # 6 more, 2 free
    assert torch.equal(b.slot_map.slots, before)  # nothing moved
    st.check_invariants()
    st.finish_request(b, cache=False)
    drained(st, ["S"])


def test_shared_prefix_survives_a_siblings_demotion_and_eviction():
    """A sibling's quantized copy lives in its own cells; the shared cells keep their
    full-precision values bit for bit and other requests keep reading them."""
    st = store()
    system = list(range(200, 240))  # 40 tokens: room for an INT2 page
    st.finish_request(run(st, "S", system + [1]))
    shared = st.prefix_cache.match(None, torch.tensor(system)).slots.clone()
    snap = [
        (st.pool.layers[layer].full.k.clone(), st.pool.layers[layer].full.v.clone())
        for layer in range(L)
    ]
    a = run(st, "A", system + [2, 3])
    b = run(st, "B", system + [4])
    assert torch.equal(a.slot_map.slots[:, :40], shared)
    # A: INT2 on its first 32, INT4 on the next 8, evict a column of position 39
    prec = torch.full((40,), P4, dtype=torch.int8)
    prec[:32] = P2
    res = st.set_precision(a, prec)
    assert res.slots_freed == 0  # every demoted full cell is still held by the tree and B
    keep = torch.ones(L, H, 40, dtype=torch.bool)
    keep[1, 1, 39] = False
    assert st.evict_per_head(a, keep).slots_freed == 1  # A's own INT4 cell goes back
    assert not bool((a.slot_map.slots[:, :40] == shared).any())  # A holds its own cells
    assert torch.equal(b.slot_map.slots[:, :40], shared)
    assert bool((st.allocator.refcount(shared) == 2).all())  # tree + B
    for layer in range(L):  # the shared cells' full-precision values, bit for bit
        full = st.pool.layers[layer].full
        cols = st.layer_cells(shared, layer)
        heads = torch.arange(H)[:, None]
        assert torch.equal(full.k[cols, heads], snap[layer][0][cols, heads])
        assert torch.equal(full.v[cols, heads], snap[layer][1][cols, heads])
    check_content(st, a)
    check_content(st, b)
    st.check_invariants()
    # A's holey, quantized turn goes to A's namespace; the shared namespace is unchanged
    st.finish_request(a)
    c = st.begin_request("C", system + [5])
    assert not c.prefix_from_session and torch.equal(c.slot_map.slots, shared)
    fill(st, c, st.extend(c))
    check_content(st, c)
    a2 = st.begin_request("A", system + [2, 3, 6])
    assert a2.prefix_from_session and a2.num_cached == 42
    assert cells_of(st, a2, Precision.INT2) == 32 * C  # matched as is: no re-quantization
    fill(st, a2, st.extend(a2))
    check_content(st, a2)
    st.check_invariants()
    for r in (b, c, a2):
        st.finish_request(r)
    drained(st, ["A", "B", "C", "S"])


def test_read_kv_dequantizes_mixed_precisions_and_holes():
    st = store()
    r = run(st, None, list(range(1, 41)))
    prec = torch.full((L, H, 40), 16, dtype=torch.int8)
    prec[0, :, :32] = P2
    prec[1, 0, 5:20] = P4
    st.set_precision(r, prec)
    keep = torch.ones(L, H, 40, dtype=torch.bool)
    keep[0, 1, 7] = False
    keep[1, :, 8] = False
    st.evict_per_head(r, keep)
    for layer in range(L):
        k, v, pos, hm = st.read_kv(r, layer)
        assert k.shape == (int(pos.numel()), H, D) and k.dtype == torch.float32
        # written values, as kv_fill encodes them: compare against what was written
        toks = torch.tensor(r.token_ids)[pos]
        wk, wv = kv_value(toks, pos, layer, H, D)
        err = (k - wk).abs().amax(dim=-1)  # [n, H]
        pr = st.layout.precision(r.slot_map.layer_slots(layer)[:, pos]).t()
        assert bool((err[pr == 16] == 0).all())
        assert bool((err[pr == P4] > 0).any()) == bool((pr == P4).any())  # really quantized
    assert 8 not in st.read_kv(r, 1)[2].tolist() and 8 in st.read_kv(r, 0)[2].tolist()
    check_content(st, r)
    st.finish_request(r, cache=False)
    drained(st)


def test_compact_int4_moves_thinned_cells_bit_for_bit_and_keeps_resident_bytes():
    """After per-token eviction thins INT4 spans, ``compact_int4`` moves the cells whose
    holders it knows (the request's own, and a matched session prefix's together with its
    tree node) into whole runs: same values read back (the codes copied, not
    re-quantized), same resident bytes, old cells free, every reference accounted for.
    Cells a sibling request also holds stay; nothing happens without an eviction since
    the last call."""
    from agentkv.cache.slot_allocator import INT4_RUN

    M = 128
    st = store(num_slots=1024, int4_min_density=0.75)
    system = list(range(300, 300 + M))  # M tokens, quantized by a first turn and cached
    first = run(st, "S", system + [1])
    st.set_precision(first, torch.full((M,), P4, dtype=torch.int8))
    st.finish_request(first)
    r = run(st, "S", system + list(range(2, 258)))  # 256 own tokens after the M matched
    node_cells = r.slot_map.slots[:, :M].clone()
    assert r.num_cached == M and bool((st.allocator.refcount(node_cells) == 2).all())
    sibling = st.begin_request("S", system + [7])  # holds the M cells too
    st.set_precision(r, torch.full((M + 256,), P4, dtype=torch.int8))
    assert st.compact_int4(r).cells_moved == 0  # nothing evicted yet
    keep = torch.ones(L, H, M + 256, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    keep[:, :, M:] = torch.rand(L, H, 256, generator=g) < 0.5  # own span thinned
    keep[1, 0, M:] = True  # one column left dense
    keep[:, :, :M] = torch.rand(L, H, M, generator=g) < 0.5  # matched span thinned
    st.evict_per_head(r, keep)
    assert r.int4_thinned
    slots = r.slot_map.slots.clone()
    cols = torch.arange(C)[:, None].expand(C, 256)
    own = slots[:, M:]
    dens = st.allocator.int4_run_density(cols[own != DEAD], own[own != DEAD])
    kv = [st.read_kv(r, layer) for layer in range(L)]
    used = st.stats().used_bytes
    assert st.compact_int4(r, min_density=0.0).cells_moved == 0 and r.int4_thinned  # off
    assert KVStore(L, H, D, 64).int4_min_density == 0.0  # off unless asked for
    res = st.compact_int4(r)
    assert not r.int4_thinned and st.compact_int4(r).cells_moved == 0
    new = r.slot_map.slots
    changed = new != slots
    assert res.columns == C - 1 and res.cells_moved == int(changed.sum())
    assert not changed[:, :M].any()  # the sibling holds them too: they stay
    assert not changed[2].any()  # (layer 1, head 0): dense, stays
    own = new[:, M:]
    dens_after = st.allocator.int4_run_density(cols[own != DEAD], own[own != DEAD])
    assert bool((dens[[0, 1, 3]] < 0.75).all())
    for c in (0, 1, 3):  # each moved column: ascending, on as few runs as its cells fill
        ids = own[c][own[c] != DEAD]
        assert bool((ids[1:] > ids[:-1]).all())
        assert float(dens_after[c]) == ids.numel() / (INT4_RUN * -(-ids.numel() // INT4_RUN))
    assert st.stats().used_bytes == used  # resident bytes unchanged
    assert bool((st.allocator.refcount(slots)[changed] == 0).all())  # old cells freed
    for layer in range(L):
        k, v, pos, hm = st.read_kv(r, layer)
        k0, v0, pos0, hm0 = kv[layer]
        assert torch.equal(pos, pos0) and torch.equal(k, k0) and torch.equal(v, v0)
        assert (hm is None and hm0 is None) or torch.equal(hm, hm0)
    check_content(st, r)
    st.check_invariants()
    # the sibling gone, the matched span moves with its tree node: both repointed
    st.finish_request(sibling, cache=False)
    keep = torch.ones(L, H, M + 256, dtype=torch.bool)
    keep[0, 0, int(torch.nonzero(r.slot_map.slots[0, :M])[0])] = False
    st.evict_per_head(r, keep)
    slots = r.slot_map.slots.clone()
    res = st.compact_int4(r)
    changed = r.slot_map.slots != slots
    assert res.cells_moved == int(changed.sum()) and bool(changed[:, :M].any())
    (node,) = [n for _, start, n in st.prefix_cache.iter_nodes() if start == 0 and len(n) == M]
    live = r.slot_map.slots[:, :M] != DEAD
    assert torch.equal(node.value[live], r.slot_map.slots[:, :M][live])  # node repointed
    assert bool((st.allocator.refcount(r.slot_map.slots[:, :M])[live] == 2).all())
    assert st.stats().used_bytes == used
    check_content(st, r)
    st.check_invariants()
    st.finish_request(r)
    drained(st, ["S"])


@pytest.mark.parametrize("seed", range(3))
def test_compact_int4_over_random_multi_turn_sessions(seed):
    """Turns of two sessions, each demoting its context to INT4 and evicting per head (the
    matched turns' cells included) before compacting: cells move, every holder reads its
    own K/V, every reference is accounted for and resident bytes never change."""
    import random

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    st = store(num_slots=1024, int4_min_density=0.75)
    history: dict[str, list[int]] = {}
    moved = 0
    for _ in range(8):
        session = rng.choice(["a", "b"])
        prompt = history.get(session, list(range(500, 500 + rng.randint(40, 120))))
        req = run(st, session, prompt + [rng.randint(0, 50) for _ in range(rng.randint(60, 150))])
        t = req.seq_len
        prec = torch.full((t,), P4, dtype=torch.int8)
        prec[-16:] = int(Precision.FULL)
        st.set_precision(req, prec)
        keep = torch.rand(L, H, t, generator=g) < rng.choice([0.3, 0.5, 0.8])
        keep[..., -16:] = True
        st.evict_per_head(req, keep)
        sibling = run(st, session, prompt + [99]) if rng.random() < 0.3 else None
        used = st.stats().used_bytes
        res = st.compact_int4(req)
        moved += res.cells_moved
        assert st.stats().used_bytes == used
        for r in (req, sibling):
            if r is not None:
                check_content(st, r)
        st.check_invariants()
        if sibling is not None:
            st.finish_request(sibling, cache=False)
        st.finish_request(req)
        history[session] = req.token_ids
    assert moved > 0
    drained(st, ["a", "b"])
