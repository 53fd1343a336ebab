"""Reference-counted allocator of KV cells, one free list per (layer, KV head) column.

The counterpart of SGLang's ``TokenToKVPoolAllocator``, at (layer, KV head) grain and over
three precisions. A *cell* is the storage of one token in one column ``c = layer * Hkv + h``;
its id is a unified slot id of that layer's :class:`agentkv.kernels.KVPools` (row ``id`` of
the full pool, of the INT4 pool after ``int4_base``, an INT2 page row after ``int2_base``),
read at head ``h``. Every column has its own free lists, so a cell evicted or demoted in one
(layer, head) goes back to that column's free list: memory is freed at the grain of the
decision. Id 0 is the dead slot (:data:`~agentkv.cache.DEAD`) in every column, never handed
out, never counted.

Every holder of a cell (a request's slot map, a prefix-cache node) holds one counted
reference; a cell is free exactly when its count is 0. INT2 cells come in pages of 32 rows of
one column (keys share per-channel scales over the page): a page is handed out whole (each
row with one reference) and goes back to the free list when all 32 rows are unreferenced.

Cell tensors are int64 ``[C, n]`` (``C`` columns, ``n`` positions), ``DEAD`` where a column
holds nothing; every method ignores DEAD entries. Bookkeeping lives on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agentkv.cache.dead_slot import DEAD
from agentkv.cache.precision import Precision
from agentkv.kernels import INT2_PAGE

INT4_RUN: int = 32
"""INT4 cells a column's bulk allocation takes per aligned run of ids (the decode kernel's
block of 32 positions): see :meth:`SlotAllocator.alloc_int4`."""


class OutOfSlots(RuntimeError):
    """Raised when an allocation needs more free cells than a column has."""


class SlotRefcountError(RuntimeError):
    """Raised on a reference-count violation: double free, a reference taken on a free cell,
    or a cell id out of range."""


def _stable_order(keys: torch.Tensor) -> torch.Tensor | None:
    """``torch.argsort(keys, stable=True)``, or None when ``keys`` (int64 ``[m]``) are
    already non-decreasing: cells listed column by column (a demotion's, from ``nonzero``
    over the map) need no sort, and the check is one O(m) pass instead of an O(m log m)
    sort (host time: a 32k-token request of an 8B model demotes ~9M cells at once)."""
    if keys.numel() < 2 or bool((keys[1:] >= keys[:-1]).all()):
        return None
    return torch.argsort(keys, stable=True)


def grouped(cols: torch.Tensor, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(cols, *values)`` stably sorted by column (as given when already grouped)."""
    order = _stable_order(cols)
    return (cols, *values) if order is None else (cols[order], *(v[order] for v in values))


def in_entry_order(cols: torch.Tensor, by_column: torch.Tensor) -> torch.Tensor:
    """``by_column`` (one value per entry of ``cols``, grouped by column, each column's in
    the order of its entries) put back in the order of ``cols``' entries."""
    order = _stable_order(cols)
    if order is None:
        return by_column
    out = torch.empty_like(by_column)
    out[order] = by_column
    return out


@dataclass(frozen=True)
class PoolLayout:
    """Unified slot ids of one layer's pools (the same for every layer).

    Attributes:
        full_slots: rows of the full-precision pool, the dead slot (row 0) included.
        int4_slots: rows of the INT4 pool.
        int2_pages: 32-row pages of the INT2 pool.
    """

    full_slots: int
    int4_slots: int = 0
    int2_pages: int = 0

    @property
    def int4_base(self) -> int:
        return self.full_slots

    @property
    def int2_base(self) -> int:
        return self.full_slots + self.int4_slots

    @property
    def num_ids(self) -> int:
        return self.int2_base + INT2_PAGE * self.int2_pages

    def precision(self, ids: torch.Tensor) -> torch.Tensor:
        """int8 :class:`Precision` of every id (``EVICTED`` for DEAD), same shape."""
        out = torch.full_like(ids, int(Precision.FULL), dtype=torch.int8)
        out[ids >= self.int4_base] = int(Precision.INT4)
        out[ids >= self.int2_base] = int(Precision.INT2)
        out[ids == DEAD] = int(Precision.EVICTED)
        return out


class _FreeStacks:
    """One LIFO stack of free ids per column (vectorized push / pop). With ``run`` and
    ``refcount`` (the allocator's counts of these ids, ``[C, len(ids)]``, a view kept in step
    by the allocator: an id is free where its count is 0), the ids (consecutive, from
    ``ids[0]``) are also counted per aligned run of ``run``, by every push and pop, for
    :meth:`take_runs`, and each free id's place in its stack is kept (``where``), so ids
    taken from the middle of a stack leave it in O(taken) (:meth:`remove_held`)."""

    def __init__(
        self,
        num_columns: int,
        ids: torch.Tensor,
        run: int = 0,
        refcount: torch.Tensor | None = None,
    ) -> None:
        self.stack = ids.to(torch.int64).repeat(num_columns, 1).contiguous()
        # reversed, so the lowest id is popped first
        self.stack = self.stack.flip(1).contiguous()
        self.top = torch.full((num_columns,), int(ids.numel()), dtype=torch.int64)
        self.run = run
        if run:
            n = int(ids.numel())
            self.base = int(ids[0]) if n else 0
            self.refcount = refcount
            sizes = torch.bincount(torch.arange(n) // run, minlength=-(-n // run))
            self.per_run = sizes.repeat(num_columns, 1)
            # where[c, id - base]: the id's place in column c's stack while it is free
            self.where = torch.arange(n - 1, -1, -1, dtype=torch.int64).repeat(num_columns, 1)

    def _track(self, cols: torch.Tensor, ids: torch.Tensor, free: bool) -> None:
        """Count ``(cols, ids)`` in (``free``) or out of their runs."""
        if not self.run or ids.numel() == 0:
            return
        runs = (ids - self.base) // self.run
        self.per_run.index_put_(
            (cols, runs), torch.full_like(runs, 1 if free else -1), accumulate=True
        )

    def check(self, counts: torch.Tensor) -> None:
        """Raise :class:`OutOfSlots` unless every column has ``counts[c]`` free ids."""
        if bool((counts > self.top).any()):
            c = int(torch.nonzero(counts > self.top)[0, 0])
            raise OutOfSlots(f"column {c} needs {int(counts[c])} cells, {int(self.top[c])} free")

    def pop(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take ``counts[c]`` ids from each column: ``(cols [m], ids [m])`` grouped by column."""
        self.check(counts)
        c = counts.numel()
        n = int(counts[0]) if c else 0
        if bool((counts == n).all()):  # as many from every column (a decode step, a chunk)
            cols = torch.arange(c)[:, None].expand(c, n).reshape(-1)
            offs = torch.arange(n).repeat(c)
        else:
            cols = torch.repeat_interleave(torch.arange(c), counts)
            first = torch.cumsum(counts, 0) - counts
            offs = torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)
        ids = self.stack[cols, self.top[cols] - 1 - offs]
        self.top -= counts
        self._track(cols, ids, False)
        return cols, ids

    def take_runs(self, col: int, k: int) -> torch.Tensor:
        """Pick ``k`` free ids of column ``col`` from its fullest aligned runs (``run``
        stacks): whole free runs first, the last run chosen in part (its lowest ids);
        returned ascending. ``k`` must not exceed the column's free ids. Not yet removed
        from the stack: the caller counts references on them, then calls
        :meth:`remove_held`. Cost: one pass over the column's run counts (the fullest runs
        found by a partial sort) and the chosen runs' cells, in numpy on views of the
        tensors (its indexing is 3-5x faster than torch's on single rows)."""
        n = self.refcount.shape[1]
        per_run = self.per_run[col].numpy()
        best = int(np.argmax(per_run))  # (the lowest of the fullest)
        if per_run[best] >= k:
            order = np.array([best])
        else:  # the runs at least as full as the need-th fullest, fullest (then lowest) first
            need = min(-(-k // self.run), per_run.size)
            cut = np.partition(per_run, per_run.size - need)[per_run.size - need]
            cand = np.flatnonzero(per_run >= cut)
            if int(per_run[cand].sum()) < k:  # (part-free runs: more of them needed)
                cand = np.arange(per_run.size)
            order = cand[np.argsort(-per_run[cand], kind="stable")]
        need = int(np.searchsorted(np.cumsum(per_run[order]), k)) + 1
        cells = (order[:need, None] * self.run + np.arange(self.run)).reshape(-1)
        cells = cells[cells < n]  # (a last, shorter run)
        local = np.sort(cells[self.refcount[col].numpy()[cells] == 0][:k])
        return torch.from_numpy(local + self.base)

    def take_fullest_run(self, cols: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """:meth:`take_runs` for columns ``cols`` (int64 ``[a]``, distinct) whose fullest
        run has ``k[a]`` free ids (a decode-time page: one run's worth in every column), all
        in a few vectorized passes: the lowest ``k`` free ids of each column's fullest run
        (the lowest such run), int64 ``[sum k]``, grouped by column in the order of
        ``cols``, ascending. Not yet removed from the stacks (:meth:`remove_held`)."""
        n = self.refcount.shape[1]
        best = torch.argmax(self.per_run[cols], dim=1)  # (the first of the fullest)
        cells = best[:, None] * self.run + torch.arange(self.run)  # [a, run] local
        free = (cells < n) & (self.refcount[cols[:, None], cells.clamp_max(n - 1)] == 0)
        pick = free & (torch.cumsum(free.int(), 1) <= k[:, None])
        return cells[pick] + self.base  # (row-major: grouped by column, ascending)

    def remove_held(self, cols: torch.Tensor, held_cols: torch.Tensor, held: torch.Tensor) -> None:
        """Drop the free ids ``(held_cols, held)`` (int64 ``[m]``, distinct, grouped by
        column in the order of ``cols``, the distinct columns they belong to) that the
        caller just took references on (counts no longer 0) from their stacks: in each
        column the ids above the new top that stay free fill the dropped ones' places below
        it, in their order. Vectorized over the columns: O(m + a * max taken per column)."""
        self._track(held_cols, held, False)
        k = torch.bincount(held_cols, minlength=self.top.numel())[cols]  # [a]
        t2 = self.top[cols] - k
        j = torch.arange(int(k.max()) if k.numel() else 0)
        in_tail = j[None, :] < k[:, None]  # [a, K]
        pos = (t2[:, None] + j).clamp_max(self.stack.shape[1] - 1)
        tail = self.stack[cols[:, None], pos]
        stays = in_tail & (self.refcount[cols[:, None], tail - self.base] == 0)
        # the dropped ids' places below the new top, by column, ascending
        row = torch.repeat_interleave(torch.arange(cols.numel()), k)
        places = self.where[held_cols, held - self.base]
        below = places < t2[row]
        width = self.stack.shape[1]
        holes = torch.sort(row[below] * width + places[below]).values
        hole_row, hole = holes // width, holes % width
        movers = tail[stays]  # (row-major: by column, in stack order)
        self.stack[cols[hole_row], hole] = movers
        self.where[cols[hole_row], movers - self.base] = hole
        self.top[cols] = t2

    def push(self, cols: torch.Tensor, ids: torch.Tensor) -> None:
        cols, ids = grouped(cols, ids)
        counts = torch.bincount(cols, minlength=self.top.numel())
        first = torch.cumsum(counts, 0) - counts
        offs = torch.arange(int(cols.numel())) - torch.repeat_interleave(first, counts)
        self.stack[cols, self.top[cols] + offs] = ids
        if self.run:
            self.where[cols, ids - self.base] = self.top[cols] + offs
        self.top += counts
        self._track(cols, ids, True)

    def contents(self, col: int) -> torch.Tensor:
        return self.stack[col, : int(self.top[col])].clone()


class SlotAllocator:
    """Hands out KV cells per (layer, KV head) column, with reference counts.

    Args:
        num_columns: ``C = L * Hkv``.
        layout: the pools' unified slot ids (:class:`PoolLayout`).
    """

    def __init__(self, num_columns: int, layout: PoolLayout) -> None:
        if layout.full_slots < 2:
            raise ValueError(
                f"full_slots must be >= 2 (one dead slot + one usable), got {layout.full_slots}"
            )
        self.num_columns = int(num_columns)
        self.layout = layout
        self._refcount = torch.zeros(num_columns, layout.num_ids, dtype=torch.int32)
        self._free = {
            Precision.FULL: _FreeStacks(num_columns, torch.arange(1, layout.full_slots)),
            Precision.INT4: _FreeStacks(
                num_columns,
                torch.arange(layout.int4_base, layout.int2_base),
                INT4_RUN,
                self._refcount[:, layout.int4_base : layout.int2_base],
            ),
            Precision.INT2: _FreeStacks(num_columns, torch.arange(layout.int2_pages)),
        }

    # ------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        """Full-precision cells per column that can ever be handed out (``full_slots - 1``)."""
        return self.layout.full_slots - 1

    @property
    def free_count(self) -> int:
        """Full-precision cells free in the column with the fewest: tokens that can still be
        extended by a request."""
        return int(self._free[Precision.FULL].top.min())

    def free_cells(self, precision: Precision) -> torch.Tensor:
        """int64 ``[C]`` free cells (INT2: free pages) per column."""
        return self._free[precision].top.clone()

    def used_cells(self) -> dict[Precision, int]:
        """Cells with at least one reference, per precision, summed over columns (INT2 counts
        rows of pages in use)."""
        lay = self.layout
        return {
            Precision.FULL: self.num_columns * (lay.full_slots - 1)
            - int(self._free[Precision.FULL].top.sum()),
            Precision.INT4: self.num_columns * lay.int4_slots
            - int(self._free[Precision.INT4].top.sum()),
            Precision.INT2: INT2_PAGE
            * (self.num_columns * lay.int2_pages - int(self._free[Precision.INT2].top.sum())),
        }

    # ---------------------------------------------------------- allocation
    def alloc(self, n: int) -> torch.Tensor:
        """``n`` full-precision cells in every column, one reference each: int64 ``[C, n]``.
        Raises :class:`OutOfSlots` (nothing taken) when a column has fewer than ``n`` free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of cells ({n})")
        counts = torch.full((self.num_columns,), n, dtype=torch.int64)
        cols, ids = self._free[Precision.FULL].pop(counts)
        self._count_pairs(cols, ids, 1)  # (ids off a free list: live, in range)
        return ids.view(self.num_columns, n)

    def alloc_int4(self, cols: torch.Tensor) -> torch.Tensor:
        """One INT4 cell for each entry of ``cols`` (int64 ``[m]``, any order): ids ``[m]``,
        each column's in the order of its entries. A column asking for at least
        :data:`INT4_RUN` cells gets them from its fullest aligned runs of ``INT4_RUN`` ids,
        ascending (so a demoted span lies on consecutive rows wherever whole runs are free,
        which the decode kernel reads faster from a head-major pool); fewer come off its
        free list's top (most recently freed first, filling holes). Raises
        :class:`OutOfSlots` (nothing taken) when a column has too few free cells."""
        counts = torch.bincount(cols, minlength=self.num_columns)
        stacks = self._free[Precision.INT4]
        stacks.check(counts)  # (nothing taken: OutOfSlots names the column)
        bulk = counts >= INT4_RUN
        asking = torch.nonzero(bulk).reshape(-1)
        # a column whose ask fits its fullest run (a decode-time page) takes it in one pass
        # with the others; the rest pick run by run; all leave the free lists in one pass
        k = counts[asking]
        fits = (k <= INT4_RUN) & (stacks.per_run[asking].amax(dim=1) >= k)
        parts = [stacks.take_fullest_run(asking[fits], k[fits])] if bool(fits.any()) else []
        parts += [stacks.take_runs(c, int(counts[c])) for c in asking[~fits].tolist()]
        bulk_cols = torch.cat(
            [asking[fits].repeat_interleave(k[fits]), asking[~fits].repeat_interleave(k[~fits])]
        )
        taken = torch.cat(parts) if parts else bulk_cols  # (empty without bulk columns)
        bulk_cols, taken = grouped(bulk_cols, taken)  # (by column, as asking is)
        self._count_pairs(bulk_cols, taken, 1)  # (remove_held tells them by their counts)
        stacks.remove_held(asking, bulk_cols, taken)
        got_cols, ids = stacks.pop(torch.where(bulk, 0, counts))
        self._count_pairs(got_cols, ids, 1)
        if taken.numel():  # every column's ids, grouped by column (as pop groups them)
            got_cols, ids = grouped(torch.cat([bulk_cols, got_cols]), torch.cat([taken, ids]))
        return in_entry_order(cols, ids)

    def compact_int4(
        self, cols: torch.Tensor, ids: torch.Tensor, min_density: float
    ) -> torch.Tensor:
        """Denser cells for INT4 cells where per-token eviction has left them sparse.

        Eviction leaves a demoted span's runs of :data:`INT4_RUN` ids part-used, and the
        decode kernel reads a head's rows slower the more runs a block of positions spans.
        ``(cols, ids)`` (int64 ``[m]``, distinct pairs; INT4 cells only) are cells the
        caller may move: it will repoint every holder of each (the caller checks that it
        knows them all). In every column, the cells of aligned runs that they fill less
        than ``min_density`` of are candidates (fuller runs stay). Where the candidates
        number at least :data:`INT4_RUN` and could lie on fewer runs, they move, in
        ascending id order, onto the column's whole free runs (lowest first): all of them
        where there are enough whole free runs, else as many whole runs' worth as there are
        (a later call moves more once the vacated runs are free). Nothing is evicted for
        this, and partly free runs are never used (they would stay sparse).

        Host cost: a few vectorized passes over the ``m`` cells and over the asking
        columns' free lists (no per-column Python work beyond one loop-free pass).

        Returns int64 ``[m]``: each entry's new cell where it moves, else its id. Every new
        cell has one reference; the caller copies each moved cell's data, repoints its
        holders (one more reference per further holder) and drops the old ids' references.
        A column's moved cells keep their order: the i-th lowest old id moves to the i-th
        lowest new one.
        """
        out = ids.clone()
        lay = self.layout
        stacks = self._free[Precision.INT4]
        if ids.numel() == 0 or lay.int4_slots < INT4_RUN:
            return out
        C, R = self.num_columns, lay.int4_slots // INT4_RUN  # (whole runs only)
        run = (ids - lay.int4_base) // INT4_RUN
        key = cols * R + run.clamp_max(R - 1)
        cnt = torch.bincount(key, minlength=C * R)
        # candidates: cells of runs they fill less than min_density of
        sparse = (cnt[key] < min_density * INT4_RUN) & (run < R)
        n = torch.bincount(cols[sparse], minlength=C)
        cnt = cnt.view(C, R)
        used = ((cnt > 0) & (cnt < min_density * INT4_RUN)).sum(1)
        whole = stacks.per_run[:, :R] == INT4_RUN
        take = torch.minimum(-(-n // INT4_RUN), whole.sum(1))
        k = torch.minimum(n, take * INT4_RUN)  # cells each column moves
        ask = (n >= INT4_RUN) & (used > -(-n // INT4_RUN)) & (take > 0)
        if not bool(ask.any()):
            return out
        asking = torch.nonzero(ask).reshape(-1)
        k = torch.where(ask, k, 0)
        # the new cells: each asking column's lowest `take` whole free runs, trimmed to k
        chosen = whole[asking] & (torch.cumsum(whole[asking].int(), 1) <= take[asking, None])
        row, runs = torch.nonzero(chosen, as_tuple=True)  # column-major, runs ascending
        new = (lay.int4_base + runs[:, None] * INT4_RUN + torch.arange(INT4_RUN)).reshape(-1)
        new_cols = asking[row].repeat_interleave(INT4_RUN)
        rank = torch.arange(new.numel()) - torch.repeat_interleave(
            torch.cumsum(take[asking] * INT4_RUN, 0) - take[asking] * INT4_RUN,
            take[asking] * INT4_RUN,
        )
        keep = rank < k[new_cols]
        new, new_cols = new[keep], new_cols[keep]
        # the moving cells: each asking column's first k candidates in id order
        where = torch.nonzero(sparse & ask[cols]).reshape(-1)
        where = where[torch.argsort(cols[where] * lay.num_ids + ids[where])]
        n_ask = torch.where(ask, n, 0)
        at = torch.arange(where.numel()) - torch.repeat_interleave(
            torch.cumsum(n_ask, 0) - n_ask, n_ask
        )
        moving = where[at < k[cols[where]]]
        out[moving] = new
        self._count_pairs(new_cols, new, 1)
        stacks.remove_held(asking, new_cols, new)
        return out

    def int4_run_density(self, cols: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float ``[C]``: per column, how full the aligned runs of :data:`INT4_RUN` ids that
        its INT4 cells among ``(cols, ids)`` (int64 ``[m]``) touch are with them (1.0:
        whole runs; NaN where a column has none)."""
        lay = self.layout
        sel = (ids >= lay.int4_base) & (ids < lay.int2_base)
        c, i = cols[sel], ids[sel]
        n = torch.bincount(c, minlength=self.num_columns).double()
        per = -(-lay.int4_slots // INT4_RUN)
        runs = torch.unique(c * per + (i - lay.int4_base) // INT4_RUN)  # (column, run) touched
        out = n / (INT4_RUN * torch.bincount(runs // per, minlength=self.num_columns))
        out[n == 0] = float("nan")
        return out

    def alloc_int2_pages(self, cols: torch.Tensor) -> torch.Tensor:
        """One INT2 page for each entry of ``cols`` (int64 ``[p]``): row ids ``[p, 32]``, each
        row with one reference."""
        counts = torch.bincount(cols, minlength=self.num_columns)
        got_cols, pages = self._free[Precision.INT2].pop(counts)
        rows = (
            self.layout.int2_base
            + in_entry_order(cols, pages)[:, None] * INT2_PAGE
            + torch.arange(INT2_PAGE)
        )
        self._count_pairs(cols[:, None].expand_as(rows).reshape(-1), rows.reshape(-1), 1)
        return rows

    # ----------------------------------------------------------- references
    def incref(self, cells: torch.Tensor) -> None:
        """One more reference on every non-DEAD cell of ``cells`` (int64 ``[C, n]``). Each must
        already be held (a reference can only be copied from a holder)."""
        cols, ids = self._pairs(cells)
        self.incref_pairs(cols, ids)

    def incref_pairs(self, cols: torch.Tensor, ids: torch.Tensor) -> None:
        """:meth:`incref` of explicit ``(cols [m], ids [m])`` pairs (no DEAD)."""
        if ids.numel() == 0:
            return
        if bool((self._refcount[cols, ids] <= 0).any()):
            bad = ids[self._refcount[cols, ids] <= 0][:8].tolist()
            raise SlotRefcountError(f"incref of free cell(s) {bad}: take references by alloc")
        self._count_pairs(cols, ids, 1)

    def decref(self, cells: torch.Tensor) -> int:
        """Drop one reference per non-DEAD cell of ``cells`` (``[C, n]``); cells reaching 0 go
        back to their column's free list (INT2 rows when their whole page is free). Returns
        the cells freed (INT2: rows of freed pages). Raises :class:`SlotRefcountError`,
        changing nothing, on a double free."""
        cols, ids = self._pairs(cells)
        return self.decref_pairs(cols, ids)

    def decref_pairs(self, cols: torch.Tensor, ids: torch.Tensor) -> int:
        """:meth:`decref` of explicit ``(cols [m], ids [m])`` pairs (no DEAD)."""
        if ids.numel() == 0:
            return 0
        num = self.layout.num_ids
        flat = cols * num + ids
        if bool((flat[1:] > flat[:-1]).all()):  # distinct and sorted (cells freed in id order)
            uniq, ucols, uids, drop = flat, cols, ids, 1
        else:
            uniq, counts = torch.unique(flat, return_counts=True)
            ucols, uids, drop = uniq // num, uniq % num, counts.to(torch.int32)
        rc = self._refcount.view(-1)
        new = rc[uniq] - drop
        if bool((new < 0).any()):
            bad = uids[new < 0][:8].tolist()
            raise SlotRefcountError(f"double free of cell(s) {bad}")
        rc[uniq] = new
        freed_now = new == 0
        zc, zi = ucols[freed_now], uids[freed_now]
        if zi.numel() == 0:
            return 0
        freed = 0
        for prec, sel in (
            (Precision.FULL, zi < self.layout.int4_base),
            (Precision.INT4, (zi >= self.layout.int4_base) & (zi < self.layout.int2_base)),
        ):
            if bool(sel.any()):
                self._free[prec].push(zc[sel], zi[sel])
                freed += int(sel.sum())
        sel = zi >= self.layout.int2_base
        if bool(sel.any()):
            page_key = torch.unique(
                zc[sel] * self.layout.int2_pages + (zi[sel] - self.layout.int2_base) // INT2_PAGE
            )
            pc, pp = (
                page_key // max(self.layout.int2_pages, 1),
                page_key % max(self.layout.int2_pages, 1),
            )
            rows = self.layout.int2_base + pp[:, None] * INT2_PAGE + torch.arange(INT2_PAGE)
            empty = (self._refcount[pc[:, None], rows] == 0).all(dim=1)
            if bool(empty.any()):
                self._free[Precision.INT2].push(pc[empty], pp[empty])
                freed += INT2_PAGE * int(empty.sum())
        return freed

    def refcount(self, cells: torch.Tensor | None = None) -> torch.Tensor:
        """Reference counts (int32): of ``cells`` (``[C, n]``, 0 at DEAD), or all ``[C, ids]``."""
        if cells is None:
            return self._refcount.clone()
        col = torch.arange(self.num_columns)[:, None].expand_as(cells)
        out = self._refcount[col, cells].clone()
        out[cells == DEAD] = 0
        return out

    def free_ids(self, col: int, precision: Precision) -> torch.Tensor:
        """The free list of one column (INT2: page numbers), for tests and debugging."""
        return self._free[precision].contents(col)

    # --------------------------------------------------------------- private
    def _pairs(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cells = torch.as_tensor(cells, dtype=torch.int64)
        if cells.dim() != 2 or cells.shape[0] != self.num_columns:
            raise ValueError(f"cells must be [C={self.num_columns}, n], got {list(cells.shape)}")
        live = cells != DEAD
        cols = torch.arange(self.num_columns)[:, None].expand_as(cells)[live]
        ids = cells[live]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_ids):
            raise SlotRefcountError(
                f"cell id out of range [1, {self.layout.num_ids}): {int(ids.min())}..{int(ids.max())}"
            )
        return cols, ids

    def _count(self, cells: torch.Tensor, delta: int) -> None:
        cols, ids = self._pairs(cells)
        self._count_pairs(cols, ids, delta)

    def _count_pairs(self, cols: torch.Tensor, ids: torch.Tensor, delta: int) -> None:
        flat = cols * self.layout.num_ids + ids
        self._refcount.view(-1).index_add_(0, flat, torch.full_like(flat, delta, dtype=torch.int32))
