"""Reference-counted, alias-aware freeing on SGLang's token allocator, with a reserved DEAD slot.

Stock SGLang gives every KV slot exactly one owner (a request row or one radix-tree node) and
frees a slot when its owner lets go. Eviction breaks that: a request row redirects evicted
positions to one shared DEAD slot, and a session's hole-preserving copy of a prefix aliases the
slots of the shared (intact) copy. So here every holder holds one reference:

- a request holds one reference on each slot allocated for it (``alloc``) and drops it with
  ``free`` (every free SGLang itself does on request slots: duplicates after a radix insert,
  over-allocated tails, aborts, retractions);
- a radix-tree node holds one reference on each slot of its value (:meth:`tree_incref` when
  the node is created, :meth:`tree_decref` when it is evicted or dropped);
- a slot returns to the free list exactly when its count reaches 0. DEAD is never counted,
  never handed out and never freed.

``pins`` counts the locked tree nodes holding a slot (a request's matched prefix is held that
way, as in SGLang); with the counts it gives the exact physical ``evictable`` / ``protected``
sizes the scheduler's admission and its idle leak check use (:meth:`physical_sizes`).

**No host sync on the request paths.** SGLang's overlap scheduler prepares batch N+1 on the
CPU while the GPU runs batch N, so a device-to-host read there stalls it; stock SGLang's
``free`` is one ``torch.cat``. Here ``free``, :meth:`tree_incref`, :meth:`tree_decref`,
:meth:`pin` and ``alloc`` only queue device work: counts change by ``index_add_`` with DEAD and
slot 0 weighted 0 (not filtered out: a boolean mask would read its length back), and the
slots counted down are appended to a *pending* list. The pending list is *settled* (slots at
0 found, deduplicated, checked for negative counts, put on the free list) in one place,
:meth:`_settle`, which every reader of the free list goes through: ``available_size`` (SGLang's
admission and ``alloc_token_slots`` ask it every step), ``alloc`` when the free list is short,
``free_pages`` / ``release_pages`` (properties: SGLang's ``merge_and_sort_free``, its idle
invariant checker), :meth:`physical_sizes`, :meth:`used_slots`, :meth:`check`. A settle costs
one device-to-host read (a few integers, the evictable / protected recount folded in when
stale) and none when nothing is pending. Where the caller knows every slot has exactly one
holder (an intact request row's duplicates after a radix insert, an LRU leaf while no slot is
aliased) :meth:`release_owned` frees at once, as stock SGLang does, and :meth:`drop_refs`
drops a request's references on slots the tree just took: nothing pending, nothing read
(the agentkv radix cache does that for FullCache requests and requests without payload).
Faults the eager code raised at once (a count going negative, a tree reference on a free
slot, a shared slot released as owned) are flagged on the device and raised at the next
settle or :meth:`check`; ``strict`` (``AGENTKV_SGLANG_STRICT=1``, the tests) still checks
them eagerly, at a sync per call.

Why not slot 0 for DEAD, as the embedded engine does: SGLang writes the K/V of padded batch
entries (CUDA-graph padding) into slot 0, so it is not a slot nobody writes. DEAD is the
allocator's highest slot (``size``) instead, taken out of the free list. Attention never reads
it (the agentkv attention backend drops DEAD from ``kv_indices``), so its contents do not matter.

All counts are int32 tensors on the allocator's device; shapes are ``[size + 1]``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator


class SlotRefcountError(RuntimeError):
    """A reference count would go negative, or a slot in use was handed out again."""


#: bits of the device-side fault flag (raised at the next settle)
_NEGATIVE = 1
_TREE_ON_FREE = 2
_NOT_OWNED = 4


class _SettledOnRead:
    """A free list of :class:`RefCountedTokenAllocator` (stored as ``_<name>``), settled
    (pending frees put on it) whenever it is read."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if obj._pending:
            obj._settle()
        return getattr(obj, self.attr)

    def __set__(self, obj: Any, value: torch.Tensor) -> None:
        setattr(obj, self.attr, value)


class RefCountedTokenAllocator(TokenToKVPoolAllocator):
    """SGLang's ``TokenToKVPoolAllocator`` (page size 1) with per-slot reference counts.

    Build it like SGLang's (same constructor), or turn an existing allocator into one with
    :meth:`adopt` (what the agentkv radix-cache backend does with the allocator SGLang built).
    """

    #: slots counted down since the last settle (int64 ``[n_i]`` each, DEAD / 0 included)
    _pending: list[torch.Tensor] | tuple = ()

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache, need_sort: bool):
        super().__init__(size, dtype, device, kvcache, need_sort)

    @classmethod
    def adopt(cls, allocator: TokenToKVPoolAllocator) -> RefCountedTokenAllocator:
        """Make ``allocator`` (a plain ``TokenToKVPoolAllocator`` nothing was allocated from
        yet) reference-counted in place: every component that holds it keeps the same object."""
        if isinstance(allocator, cls):
            return allocator
        if type(allocator) is not TokenToKVPoolAllocator:
            raise TypeError(
                f"agentkv needs SGLang's TokenToKVPoolAllocator (page size 1), got "
                f"{type(allocator).__name__}: run with --page-size 1 and without hybrid "
                "SWA / hierarchical cache"
            )
        allocator.__class__ = cls
        # the free lists become properties (settled on read): drop the plain attributes
        allocator.__dict__.pop("free_pages", None)
        allocator.__dict__.pop("release_pages", None)
        allocator.clear()
        return allocator

    # ---- the free lists (settled on read: SGLang's merge_and_sort_free, its idle checker) ------

    free_pages = _SettledOnRead()
    release_pages = _SettledOnRead()

    # ---- SGLang's allocator interface ------------------------------------------------------

    @property
    def dead_slot(self) -> int:
        """The reserved DEAD slot id (the highest slot, ``size``)."""
        return self.size

    def clear(self) -> None:
        self._pending = []
        super().clear()
        self._free_pages = self._free_pages[:-1]  # arange(1, size + 1) without DEAD (= size)
        n = self.size + 1
        self.refs = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.tree_refs = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.pins = torch.zeros(n, dtype=torch.int32, device=self.device)
        #: nonzero: a fault seen on the device (``_NEGATIVE`` / ``_TREE_ON_FREE`` /
        #: ``_NOT_OWNED`` bits), raised at the next settle
        self._fault = torch.zeros((), dtype=torch.int32, device=self.device)
        self._version = 0  # bumped by every change of counts; keys the cached sizes
        self._sizes: tuple[int, tuple[int, int]] | None = None

    #: check every count change eagerly (a host sync per call: tests and debugging;
    #: ``AGENTKV_SGLANG_STRICT=1``). Off, faults are raised at the next settle.
    strict: bool = os.environ.get("AGENTKV_SGLANG_STRICT") == "1"

    def available_size(self) -> int:
        return len(self.free_pages) + len(self._release_pages)  # free_pages settles

    def alloc(self, need_size: int):
        if need_size > len(self._free_pages):
            if self._pending:
                self._settle()
            if self.need_sort and need_size > len(self._free_pages):
                self.merge_and_sort_free()
        if need_size > len(self._free_pages):
            return None
        select = self._free_pages[:need_size]
        self._free_pages = self._free_pages[need_size:]
        if select.numel():
            if self.strict and bool((self.refs[select] != 0).any()):
                raise SlotRefcountError("allocator handed out a slot that is still referenced")
            # no version bump: a slot held by a request alone is neither evictable nor
            # protected, so the cached sizes stay right (and decode steps need no host sync)
            self.refs[select] = 1
        return select

    def free(self, free_index: torch.Tensor) -> None:
        """Drop one request reference on each slot (DEAD ignored); slots reaching 0 go back to
        the free list at the next settle."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:  # freed at free_group_end, through this method
            self.free_group.append(free_index)
            return
        self._decref(free_index, tree=False)

    def release_owned(self, slots: torch.Tensor, tree: bool = False) -> None:
        """Drop the one reference each of ``slots`` has and free them now, as stock SGLang's
        ``free`` does: nothing pending, nothing read back. The caller guarantees what makes
        that exact: distinct live slots (no DEAD, no 0), each held by exactly one holder (the
        request, or with ``tree`` one tree node): a request's duplicates after a radix insert,
        an intact request's slots on abort, an LRU leaf while no slot is aliased. Checked
        eagerly when ``strict``, else on the device (raised at the next settle)."""
        if slots.numel() == 0:
            return
        s, w = self._weighted(slots)
        bad = (self.refs[s] != 1) | (w == 0)
        bad = bad | (self.tree_refs[s] != (1 if tree else 0))
        if self.strict and torch.unique(s).numel() != s.numel():
            bad = torch.ones_like(bad)
        self._fault_if(bad, _NOT_OWNED, "release_owned: a slot not held by exactly one holder")
        self.refs.index_add_(0, s, -w)
        if tree:
            self.tree_refs.index_add_(0, s, -w)
        self._version += 1
        self._put_free(s.to(self._free_pages.dtype))

    def drop_refs(self, slots: torch.Tensor) -> None:
        """Drop one request reference on each of ``slots``, which a tree node also holds (just
        inserted): none reaches 0, so nothing is pending. Checked eagerly when ``strict``, else
        on the device."""
        if slots.numel() == 0:
            return
        s, w = self._weighted(slots)
        bad = ((self.refs[s] < 2) | (self.tree_refs[s] < 1)) & (w > 0)
        self._fault_if(bad, _NOT_OWNED, "drop_refs: a slot the tree does not hold")
        self.refs.index_add_(0, s, -w)
        self._version += 1

    # ---- tree references ---------------------------------------------------------------------

    def tree_incref(self, slots: torch.Tensor) -> None:
        """A radix-tree node now holds ``slots`` (int ``[n]``; DEAD ignored)."""
        if slots.numel() == 0:
            return
        s, w = self._weighted(slots)
        bad = (self.refs[s] <= 0) & (w > 0)
        self._fault_if(bad, _TREE_ON_FREE, "a tree node took a reference on a free slot")
        self.refs.index_add_(0, s, w)
        self.tree_refs.index_add_(0, s, w)
        self._version += 1

    def tree_decref(self, slots: torch.Tensor) -> None:
        """A radix-tree node let go of ``slots``; those reaching 0 go back to the free list at
        the next settle (``available_size()`` says how many did)."""
        if slots.numel():
            self._decref(slots, tree=True)

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """A tree node holding ``slots`` was locked (``+1``) or unlocked (``-1``)."""
        if slots.numel():
            s, w = self._weighted(slots)
            self.pins.index_add_(0, s, w * delta)
            self._version += 1

    # ---- accounting --------------------------------------------------------------------------

    def physical_sizes(self) -> tuple[int, int]:
        """``(evictable, protected)`` in slots: held only by unlocked tree nodes / by a locked
        tree node and no request (DEAD counted as protected, so ``available + evictable +
        protected == size`` when no request holds a slot, SGLang's idle invariant). Cached until
        the counts change (the scheduler asks several times per step); a recount is one host
        read, shared with the settle of pending frees."""
        if self._sizes is None or self._sizes[0] != self._version:
            self._settle(sizes=True)
        assert self._sizes is not None
        return self._sizes[1]

    def used_slots(self) -> int:
        """Slots with at least one reference."""
        self._settle()
        return int((self.refs > 0).sum())

    def check(self) -> None:
        """Recount: no negative count, free list == unreferenced slots (DEAD and 0 excluded),
        no duplicate in the free list. Raises :class:`SlotRefcountError`."""
        self._settle()
        if int(self._fault):
            self._settle(sizes=True, force=True)  # raises it
        if bool((self.refs < 0).any() | (self.tree_refs < 0).any() | (self.pins < 0).any()):
            raise SlotRefcountError("negative reference count")
        if bool((self.tree_refs > self.refs).any()):
            raise SlotRefcountError("more tree references than references")
        free = torch.cat((self._free_pages, self._release_pages))
        if free.numel() != torch.unique(free).numel():
            raise SlotRefcountError("a slot is twice in the free list")
        if bool((self.refs[free] != 0).any()):
            raise SlotRefcountError("a referenced slot is in the free list")
        if bool((free == self.dead_slot).any()):
            raise SlotRefcountError("DEAD is in the free list")
        unreferenced = int((self.refs[1 : self.size] == 0).sum())
        if unreferenced != free.numel():
            raise SlotRefcountError(
                f"{unreferenced} unreferenced slots but {free.numel()} in the free list (leak)"
            )

    @property
    def pending_slots(self) -> int:
        """Entries counted down and not settled yet (no host read)."""
        return sum(int(p.numel()) for p in self._pending)

    # ---- internals ---------------------------------------------------------------------------

    def _weighted(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots`` as int64 on the counts' device and an int32 weight per entry: 0 for DEAD
        and slot 0 (never counted), 1 otherwise. No host read (a mask would need one)."""
        s = slots.reshape(-1).to(device=self.refs.device, dtype=torch.int64)
        w = ((s != self.dead_slot) & (s != 0)).to(torch.int32)
        return s, w

    def _fault_if(self, bad: torch.Tensor, bit: int, message: str) -> None:
        """A fault where ``bad`` (bool, any shape) holds: raised now when ``strict`` (a host
        read), else flagged on the device (``bit`` of ``_fault``) and raised at the next
        settle."""
        if self.strict:
            if bool(bad.any()):
                raise SlotRefcountError(message)
        else:
            self._fault.bitwise_or_(bad.any().to(torch.int32) * bit)

    def _decref(self, slots: torch.Tensor, tree: bool) -> None:
        s, w = self._weighted(slots)
        self.refs.index_add_(0, s, -w)
        if tree:
            self.tree_refs.index_add_(0, s, -w)
        self._version += 1
        # pending until the next settle: never a view of the caller's (reusable) buffer
        self._pending.append(s.clone() if s.data_ptr() == slots.data_ptr() else s)
        if self.strict:
            neg = (self.refs[s] < 0).any()
            if tree:
                neg = neg | (self.tree_refs[s] < 0).any()
            if bool(neg):
                raise SlotRefcountError(f"slot freed more often than referenced: {s.tolist()[:8]}")

    def _settle(self, sizes: bool = False, force: bool = False) -> None:
        """Put the pending slots whose count is 0 on the free list (each once; DEAD and slot 0
        never), raise any fault seen on the device, and with ``sizes`` (or when the cached
        sizes are stale anyway) recount ``physical_sizes``: one host read in all, none when
        nothing is pending and ``sizes`` is not asked for.

        Not through SGLang's ``free``: inside a free group (SGLang's decode-result step) that
        would queue them for ``free_group_end``, which calls :meth:`free` and would count them
        down a second time."""
        stale = self._sizes is None or self._sizes[0] != self._version
        if not self._pending and not (sizes and stale) and not force:
            return
        parts = [self._fault.to(torch.int64).reshape(1)]
        p = None
        if self._pending:
            p = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending)
            self._pending = []
            p = torch.sort(p).values
            first = torch.ones_like(p, dtype=torch.bool)
            first[1:] = p[1:] != p[:-1]
            r = self.refs[p]
            keep = first & (r == 0) & (p != 0) & (p != self.dead_slot)
            neg = (r < 0).any() | (self.tree_refs[p] < 0).any()
            parts[0] = parts[0] | (neg.to(torch.int64) * _NEGATIVE)
            parts.append(keep.sum().reshape(1))
        if stale:
            tree_only = (self.refs > 0) & (self.refs == self.tree_refs)
            locked = self.pins > 0
            parts.append((tree_only & ~locked).sum().reshape(1))
            parts.append((tree_only & locked).sum().reshape(1))
        host = torch.cat(parts).tolist()  # the one host read
        fault = host.pop(0)
        if fault:
            self._fault.zero_()
            what = []
            if fault & _NEGATIVE:
                what.append("slot freed more often than referenced (negative count)")
            if fault & _TREE_ON_FREE:
                what.append("a tree node took a reference on a free slot")
            if fault & _NOT_OWNED:
                what.append("release_owned / drop_refs on a slot with other holders")
            raise SlotRefcountError("; ".join(what))
        if p is not None:
            n = host.pop(0)
            if n:
                # the kept slots, ascending, moved to the front (a sort: no host read)
                order = torch.argsort((~keep).to(torch.int8), stable=True)
                self._put_free(p[order[:n]].to(self._free_pages.dtype))
        if stale:
            self._sizes = (self._version, (host[0], host[1] + 1))

    def _put_free(self, slots: torch.Tensor) -> None:
        if self.need_sort:
            self._release_pages = torch.cat((self._release_pages, slots))
        else:
            self._free_pages = torch.cat((self._free_pages, slots))
