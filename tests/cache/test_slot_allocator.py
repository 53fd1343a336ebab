import pytest
import torch

from agentkv.cache import DEAD, OutOfSlots, PoolLayout, Precision, SlotAllocator, SlotRefcountError
from agentkv.kernels import INT2_PAGE

C = 3  # columns (L * Hkv)


def alloc(full=9, int4=4, int2_pages=2, columns=C):
    return SlotAllocator(columns, PoolLayout(full, int4, int2_pages))


def col(cells, c):
    """A [C, n] cell tensor holding ``cells`` in column ``c`` and DEAD elsewhere."""
    out = torch.full((C, len(cells)), DEAD, dtype=torch.int64)
    out[c] = torch.as_tensor(cells)
    return out


def test_layout_ids_and_precision():
    lay = PoolLayout(9, 4, 2)
    assert (lay.int4_base, lay.int2_base, lay.num_ids) == (9, 13, 13 + 64)
    ids = torch.tensor([DEAD, 1, 8, 9, 12, 13, 76])
    assert lay.precision(ids).tolist() == [0, 16, 16, 4, 4, 2, 2]


def test_dead_slot_is_reserved_and_never_handed_out():
    a = alloc()
    assert a.capacity == 8 and a.free_count == 8
    got = a.alloc(8)
    assert got.shape == (C, 8)
    assert not bool((got == DEAD).any())
    for c in range(C):  # every column has its own cells 1..8
        assert sorted(got[c].tolist()) == list(range(1, 9))
    assert a.free_count == 0
    assert bool((a.refcount(got) == 1).all())
    assert bool((a.refcount()[:, DEAD] == 0).all())


def test_out_of_slots_is_clear_and_takes_nothing():
    a = alloc()
    a.alloc(3)
    before = a.refcount()
    with pytest.raises(OutOfSlots, match="needs 6 cells, 5 free"):
        a.alloc(6)
    assert a.free_count == 5 and torch.equal(a.refcount(), before)
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_refcounts_free_only_at_zero():
    a = alloc()
    s = a.alloc(2)
    a.incref(s)
    assert a.decref(s) == 0  # 2 -> 1
    assert a.free_count == 6
    assert a.decref(s) == 2 * C
    assert a.free_count == 8


def test_repeated_entries_count_each():
    a = alloc()
    s = a.alloc(1)
    a.incref(torch.cat([s, s], dim=1))
    assert a.refcount(s).tolist() == [[3]] * C
    assert a.decref(torch.cat([s, s, s], dim=1)) == C


def test_double_free_raises_and_changes_nothing():
    a = alloc()
    s = a.alloc(2)
    a.decref(s[:, :1])
    before = a.refcount()
    with pytest.raises(SlotRefcountError, match="double free"):
        a.decref(s)  # s[:, 0] is already free; s[:, 1] alone would be fine
    assert torch.equal(a.refcount(), before)
    assert a.free_count == 7


def test_incref_of_free_cell_out_of_range_or_bad_shape_raises():
    a = alloc()
    with pytest.raises(SlotRefcountError, match="free cell"):
        a.incref(col([1], 0))
    with pytest.raises(SlotRefcountError, match="out of range"):
        a.decref(col([a.layout.num_ids], 0))
    with pytest.raises(ValueError, match="cells must be"):
        a.decref(torch.tensor([1]))
    # DEAD entries are ignored everywhere
    assert a.decref(torch.full((C, 4), DEAD)) == 0
    a.incref(torch.full((C, 4), DEAD))
    assert a.refcount(torch.full((C, 1), DEAD)).tolist() == [[0]] * C


def test_columns_are_independent_per_head_frees():
    """Freeing a cell in one column returns exactly that column's cell."""
    a = alloc()
    s = a.alloc(3)
    one = torch.full_like(s, DEAD)
    one[1, 2] = s[1, 2]
    assert a.decref(one) == 1
    assert a.free_cells(Precision.FULL).tolist() == [5, 6, 5]
    assert a.free_ids(1, Precision.FULL).tolist()[-1] == int(s[1, 2])  # top of its stack
    assert int(s[1, 2]) not in a.free_ids(0, Precision.FULL).tolist()
    assert a.free_count == 5  # tokens extendable: the fullest column decides
    assert a.used_cells()[Precision.FULL] == 3 * C - 1


def test_freed_cells_are_reused_first_and_free_lists_have_no_duplicates():
    a = alloc()
    s = a.alloc(3)
    a.decref(s[:, 1:2])
    assert torch.equal(a.alloc(1), s[:, 1:2])
    for c in range(C):
        for p in (Precision.FULL, Precision.INT4, Precision.INT2):
            free = a.free_ids(c, p).tolist()
            assert len(free) == len(set(free))
            assert p == Precision.INT2 or DEAD not in free  # INT2 lists page numbers


def test_int4_cells_per_column():
    a = alloc()
    lay = a.layout
    cols = torch.tensor([2, 0, 2, 2])
    ids = a.alloc_int4(cols)
    assert bool((ids >= lay.int4_base).all()) and bool((ids < lay.int2_base).all())
    assert len(set(ids[cols == 2].tolist())) == 3  # distinct within a column
    assert a.free_cells(Precision.INT4).tolist() == [3, 4, 1]
    assert a.used_cells()[Precision.INT4] == 4
    for c, i in zip(cols.tolist(), ids.tolist(), strict=True):
        assert int(a.refcount()[c, i]) == 1
    with pytest.raises(OutOfSlots):
        a.alloc_int4(torch.tensor([2, 2]))  # column 2 has one left
    assert a.free_cells(Precision.INT4).tolist() == [3, 4, 1]
    assert a.decref_pairs(cols, ids) == 4
    assert a.free_cells(Precision.INT4).tolist() == [4, 4, 4]


def test_int2_pages_go_back_only_when_every_row_is_free():
    a = alloc()
    lay = a.layout
    rows = a.alloc_int2_pages(torch.tensor([1, 1]))
    assert rows.shape == (2, INT2_PAGE)
    page0 = (rows[:, 0] - lay.int2_base) // INT2_PAGE
    assert sorted(page0.tolist()) == [0, 1]
    for r in rows:  # whole aligned pages, rows in order
        assert r.tolist() == list(range(int(r[0]), int(r[0]) + INT2_PAGE))
        assert (int(r[0]) - lay.int2_base) % INT2_PAGE == 0
    assert a.free_cells(Precision.INT2).tolist() == [2, 0, 2]
    assert a.used_cells()[Precision.INT2] == 2 * INT2_PAGE
    c1 = torch.ones(INT2_PAGE, dtype=torch.int64)
    assert a.decref_pairs(c1[:31], rows[0, :31]) == 0  # one row still held: page in use
    assert a.free_cells(Precision.INT2).tolist() == [2, 0, 2]
    assert a.decref_pairs(c1[:1], rows[0, 31:]) == INT2_PAGE
    assert a.free_cells(Precision.INT2).tolist() == [2, 1, 2]
    with pytest.raises(SlotRefcountError, match="double free"):
        a.decref_pairs(c1[:1], rows[0, :1])
    # an incref'd row keeps its page alive
    a.incref(col(rows[1, :1], 1))
    assert a.decref_pairs(c1, rows[1]) == 0
    assert a.decref(col(rows[1, :1], 1)) == INT2_PAGE
    assert a.free_cells(Precision.INT2).tolist() == [2, 2, 2]
    with pytest.raises(OutOfSlots):
        a.alloc_int2_pages(torch.tensor([0, 0, 0]))


def test_full_slots_must_leave_room_beside_dead():
    with pytest.raises(ValueError, match="full_slots"):
        SlotAllocator(1, PoolLayout(1))


def test_int4_bulk_allocation_takes_whole_free_runs():
    """A column asking for >= INT4_RUN cells gets its fullest aligned runs of 32 ids, in
    ascending order (a demoted span on consecutive rows); fewer cells come off the free
    list's top (the holes most recently freed); columns of both kinds in one call."""
    from agentkv.cache.slot_allocator import INT4_RUN

    a = SlotAllocator(2, PoolLayout(2, 256, 0))
    base = a.layout.int4_base
    cells = a.alloc_int4(torch.zeros(256, dtype=torch.int64))
    assert torch.equal(cells, base + torch.arange(256))  # a fresh column: one run
    a.decref_pairs(torch.zeros(64, dtype=torch.int64), cells[:128:2])  # holes in runs 0-3
    a.decref_pairs(torch.zeros(64, dtype=torch.int64), cells[160:224])  # runs 5 and 6 whole
    got = a.alloc_int4(torch.zeros(INT4_RUN + 8, dtype=torch.int64))
    # run 5 whole, then 8 of run 6 (its lowest): ascending
    assert torch.equal(got, base + torch.cat([torch.arange(160, 192), torch.arange(192, 200)]))
    few = a.alloc_int4(torch.zeros(3, dtype=torch.int64))
    assert (few - base).tolist() == [223, 222, 221]  # the top: the last cells freed
    # a column of each kind in one call, in the order of the entries
    cols = torch.tensor([1] * 40 + [0] * 2)
    ids = a.alloc_int4(cols[torch.randperm(42, generator=torch.Generator().manual_seed(0))])
    per_col = a.refcount()[1, base:].nonzero().reshape(-1)
    assert torch.equal(per_col, torch.arange(40))  # column 1's first 40 rows, taken whole
    assert int((ids >= base).sum()) == 42
    used = (256 - 128 + 40 + 3 + 2) + 40  # columns 0 and 1
    assert a.used_cells()[Precision.INT4] == used
    with pytest.raises(OutOfSlots):  # nothing taken
        a.alloc_int4(torch.tensor([1] * 10 + [0] * 300))
    assert a.used_cells()[Precision.INT4] == used


def test_int4_run_bookkeeping_follows_the_free_lists():
    """The free-run counts and flags the bulk path reads are kept by every pop, push and
    bulk take: after a random churn they equal what the free lists hold."""
    import random

    from agentkv.cache.slot_allocator import INT4_RUN

    rng = random.Random(3)
    a = SlotAllocator(2, PoolLayout(2, 300, 0))  # 300: a last run of 12 cells
    base, held = a.layout.int4_base, []
    for _ in range(200):
        if held and rng.random() < 0.45:
            cols, ids = held.pop(rng.randrange(len(held)))
            gone = torch.rand(ids.numel(), generator=torch.Generator().manual_seed(len(held)))
            keep = gone < (0.5 if rng.random() < 0.5 else 0.0)
            a.decref_pairs(cols[~keep], ids[~keep])
            if bool(keep.any()):
                held.append((cols[keep], ids[keep]))
            continue
        n = rng.choice([1, 5, 31, 32, 40, 90])
        cols = torch.full((n,), rng.randrange(2), dtype=torch.int64)
        if int(a.free_cells(Precision.INT4)[int(cols[0])]) >= n:
            held.append((cols, a.alloc_int4(cols)))
    stacks = a._free[Precision.INT4]
    for c in range(2):
        free = a.free_ids(c, Precision.INT4) - base
        flags = torch.zeros(300, dtype=torch.bool)
        flags[free] = True
        assert torch.equal(stacks.refcount[c] == 0, flags)  # (free: no references)
        assert torch.equal(stacks.per_run[c], torch.bincount(free // INT4_RUN, minlength=10))
        assert len(set(free.tolist())) == free.numel()


def test_int4_compaction_moves_a_sparse_columns_cells_into_whole_runs_in_order():
    """A column's cells that per-token eviction left in half-empty runs move to its fullest
    free runs (order kept, one reference each, the old ids still held until the caller
    drops them); dense columns, columns not asked about and columns without free runs
    stay."""
    from agentkv.cache.slot_allocator import INT4_RUN

    a = SlotAllocator(3, PoolLayout(2, 256, 0))
    base = a.layout.int4_base
    cols = torch.arange(3).repeat_interleave(128)
    held = a.alloc_int4(cols).view(3, 128)  # runs 0-3 of each column
    keep = torch.arange(128) % 2 == 0  # every other position evicted in columns 0 and 2
    a.decref_pairs(torch.zeros(64, dtype=torch.int64), held[0, ~keep])
    a.decref_pairs(torch.full((64,), 2, dtype=torch.int64), held[2, ~keep])
    ids = torch.cat([held[0, keep], held[1]])  # column 2 not asked about
    cc = torch.cat([torch.zeros(64), torch.ones(128)]).long()
    assert a.int4_run_density(cc, ids)[:2].tolist() == [0.5, 1.0]
    assert a.int4_run_density(cc, ids)[2].isnan()
    new = a.compact_int4(cc, ids, min_density=0.75)
    moved = new != ids
    assert moved[:64].all() and not moved[64:].any()  # column 0 only
    # runs 4 and 5: whole, ascending in the order of the old cells
    assert torch.equal(new[:64], base + 128 + torch.arange(64))
    assert a.int4_run_density(cc, new)[0] == 1.0
    assert bool((a.refcount()[0, new[:64]] == 1).all())
    assert bool((a.refcount()[0, ids[:64]] == 1).all())  # the caller's to drop
    a.decref_pairs(cc[:64], ids[:64])
    assert a.free_cells(Precision.INT4).tolist() == [256 - 64, 128, 256 - 64]
    # compacted: nothing more to do; a threshold of 0 never moves anything
    assert torch.equal(a.compact_int4(cc, new, 0.75), new)
    assert torch.equal(a.compact_int4(cc, ids, 0.0), ids)
    # free cells too scattered to help: given back, nothing moves, nothing leaks
    b = SlotAllocator(1, PoolLayout(2, 4 * INT4_RUN, 0))
    all_ = b.alloc_int4(torch.zeros(4 * INT4_RUN, dtype=torch.int64))
    b.decref_pairs(torch.zeros(2 * INT4_RUN, dtype=torch.int64), all_[1::2])
    mine = all_[0::2]
    zeros = torch.zeros_like(mine)
    free_before = b.free_ids(0, Precision.INT4).sort().values
    assert torch.equal(b.compact_int4(zeros, mine, 0.75), mine)
    assert torch.equal(b.free_ids(0, Precision.INT4).sort().values, free_before)
    assert int(b.refcount().sum()) == 2 * INT4_RUN
    # fewer than a run's worth of cells: not worth a move
    assert torch.equal(b.compact_int4(zeros[:8], mine[:8], 1.0), mine[:8])


def test_int4_compaction_with_few_whole_free_runs_moves_in_steps():
    """With fewer whole free runs than the sparse cells need, a call moves as many whole
    runs' worth (the lowest old ids first) and the next call, once the caller has freed
    the vacated cells, moves more; the free lists and run counts stay exact throughout."""
    from agentkv.cache.slot_allocator import INT4_RUN

    a = SlotAllocator(1, PoolLayout(2, 10 * INT4_RUN, 0))
    base = a.layout.int4_base
    held = a.alloc_int4(torch.zeros(8 * INT4_RUN, dtype=torch.int64))  # runs 0-7; 8, 9 free
    gone = torch.arange(8 * INT4_RUN) % 4 != 0  # keep a quarter: 64 cells on 8 runs
    a.decref_pairs(torch.zeros(int(gone.sum()), dtype=torch.int64), held[gone])
    mine = held[~gone]
    zeros = torch.zeros_like(mine)
    # runs 0-7 each keep 8 cells (not whole): only runs 8 and 9 are whole and free
    new = a.compact_int4(zeros, mine, 0.75)
    moved = new != mine
    assert torch.equal(new[moved], base + 8 * INT4_RUN + torch.arange(2 * INT4_RUN))
    assert torch.equal(moved, torch.arange(64) < 64)  # 64 cells fit the 2 runs: all move
    a.decref_pairs(zeros[moved], mine[moved])
    stacks = a._free[Precision.INT4]
    for c in range(1):
        free = a.free_ids(c, Precision.INT4) - base
        assert len(set(free.tolist())) == free.numel() == 8 * INT4_RUN
        assert torch.equal(stacks.per_run[c], torch.bincount(free // INT4_RUN, minlength=10))
        assert bool((a.refcount()[c, base + free] == 0).all())
    # one whole free run for 3 runs' worth of sparse cells: one run now, the rest later
    b = SlotAllocator(1, PoolLayout(2, 7 * INT4_RUN, 0))
    held = b.alloc_int4(torch.zeros(6 * INT4_RUN, dtype=torch.int64))
    gone = torch.arange(6 * INT4_RUN) % 2 == 1  # half of runs 0-5: 96 cells on 6 runs
    b.decref_pairs(torch.zeros(int(gone.sum()), dtype=torch.int64), held[gone])
    mine = held[~gone]
    zeros = torch.zeros_like(mine)
    new = b.compact_int4(zeros, mine, 0.75)
    moved = new != mine
    assert int(moved.sum()) == INT4_RUN and bool(moved[:INT4_RUN].all())  # the lowest ids
    assert torch.equal(new[moved], base + 6 * INT4_RUN + torch.arange(INT4_RUN))
    b.decref_pairs(zeros[moved], mine[moved])  # runs 0 and 1 are now whole and free
    again = b.compact_int4(zeros, new, 0.75)
    more = again != new
    assert int(more.sum()) == 2 * INT4_RUN  # the remaining 64 onto runs 0 and 1
    assert torch.equal(again[more], base + torch.arange(2 * INT4_RUN))
    b.decref_pairs(zeros[more], new[more])
    assert b.int4_run_density(zeros, again)[0] == 1.0
    free = b.free_ids(0, Precision.INT4) - base
    assert torch.equal(free.sort().values, torch.arange(2 * INT4_RUN, 6 * INT4_RUN))  # runs 2-5
    assert torch.equal(
        b._free[Precision.INT4].per_run[0], torch.bincount(free // INT4_RUN, minlength=7)
    )


def test_one_run_per_column_in_one_pass_matches_the_per_column_path():
    """A run's worth of cells in every column (a decode-time page) is taken for all
    columns at once: the same ids, and the same free lists in the same order, as taking
    each column's fullest run one column at a time; the run counts stay exact."""
    import copy
    import random

    from agentkv.cache.slot_allocator import INT4_RUN

    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    a = SlotAllocator(6, PoolLayout(2, 12 * INT4_RUN, 0))
    base = a.layout.int4_base
    held = []
    for _ in range(40):  # churn: bulk and small allocations, whole and partial frees
        if held and rng.random() < 0.4:
            cols, ids = held.pop(rng.randrange(len(held)))
            gone = torch.rand(ids.numel(), generator=g) < rng.choice([0.3, 1.0])
            a.decref_pairs(cols[gone], ids[gone])
            if bool((~gone).any()):
                held.append((cols[~gone], ids[~gone]))
            continue
        cols = torch.randint(0, 6, (rng.choice([3, 20, 70]),), generator=g)
        if bool((torch.bincount(cols, minlength=6) <= a.free_cells(Precision.INT4)).all()):
            held.append((cols, a.alloc_int4(cols)))
    b = copy.deepcopy(a)
    sa = a._free[Precision.INT4]
    assert bool((sa.per_run.amax(dim=1) == INT4_RUN).all())  # (the one-pass path for all)
    assert bool((sa.per_run < INT4_RUN).any())  # (and the churn left part-free runs)
    page = torch.arange(6).repeat_interleave(INT4_RUN)
    fast = a.alloc_int4(page)  # all columns at once
    sb = b._free[Precision.INT4]
    slow = torch.cat([sb.take_runs(c, INT4_RUN) for c in range(6)])  # one column at a time
    b._count_pairs(page, slow, 1)
    sb.remove_held(torch.arange(6), page, slow)
    assert torch.equal(fast, slow)
    assert torch.equal(sa.top, b._free[Precision.INT4].top)
    for c in range(6):
        assert torch.equal(a.free_ids(c, Precision.INT4), b.free_ids(c, Precision.INT4))
        free = a.free_ids(c, Precision.INT4) - base
        assert torch.equal(sa.per_run[c], torch.bincount(free // INT4_RUN, minlength=12))
        assert torch.equal(sa.where[c, free], torch.arange(free.numel()))  # places kept
        assert bool((a.refcount()[c, base + free] == 0).all())
    assert torch.equal(a.refcount(), b.refcount())


def test_entry_order_does_not_change_what_each_column_gets_or_frees():
    """Cells listed column by column (a demotion's) skip the sorts; any other order gives
    each column the same ids in the order of its entries, and freeing in any order leaves
    the same free lists (INT4 bulk and single cells, INT2 pages, full cells)."""
    g = torch.Generator().manual_seed(5)
    lay = PoolLayout(64, 256, 4)
    a, b = SlotAllocator(3, lay), SlotAllocator(3, lay)
    counts = torch.tensor([70, 5, 40])
    cols = torch.repeat_interleave(torch.arange(3), counts)  # sorted
    perm = torch.randperm(cols.numel(), generator=g)
    ia, ib = a.alloc_int4(cols), b.alloc_int4(cols[perm])
    for c in range(3):
        assert torch.equal(ia[cols == c], ib[cols[perm] == c])
    pages = torch.tensor([0, 2, 2])
    ra, rb = a.alloc_int2_pages(pages), b.alloc_int2_pages(pages.flip(0))
    assert torch.equal(ra[0], rb[2]) and torch.equal(ra[1:], rb[:2])
    fa, fb = a.alloc(9), b.alloc(9)
    assert torch.equal(fa, fb)
    # free half of everything, sorted in one, shuffled in the other
    drop = torch.rand(ia.numel(), generator=g) < 0.5
    fc = torch.arange(3)[:, None].expand(3, 9).reshape(-1)
    pairs = [
        (cols[drop], ia[drop]),
        (pages[:, None].expand(3, INT2_PAGE).reshape(-1), ra.reshape(-1)),
        (fc[::2], fa.reshape(-1)[::2]),
    ]
    for pc, pi in pairs:
        shuffle = torch.randperm(pc.numel(), generator=g)
        assert a.decref_pairs(pc, pi) == b.decref_pairs(pc[shuffle], pi[shuffle]) > 0
    for p in (Precision.FULL, Precision.INT4, Precision.INT2):
        for c in range(3):
            assert torch.equal(a.free_ids(c, p), b.free_ids(c, p))
    assert torch.equal(a.refcount(), b.refcount())
