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

Why not slot 0 for DEAD, as the embedded engine does: SGLang writes the K/V of padded batch
entries (CUDA-graph padding) into slot 0, so it is not a slot nobody writes. DEAD is the
allocator's highest slot (``size``) instead, taken out of the free list. Attention never reads
it (the agentkv attention backend drops DEAD from ``kv_indices``), so its contents do not matter.

All counts are int32 tensors on the allocator's device; shapes are ``[size + 1]``.
"""

from __future__ import annotations

import os

import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator


class SlotRefcountError(RuntimeError):
    """A reference count would go negative, or a slot in use was handed out again."""


class RefCountedTokenAllocator(TokenToKVPoolAllocator):
    """SGLang's ``TokenToKVPoolAllocator`` (page size 1) with per-slot reference counts.

    Build it like SGLang's (same constructor), or turn an existing allocator into one with
    :meth:`adopt` (what the agentkv radix-cache backend does with the allocator SGLang built).
    """

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
        allocator.clear()
        return allocator

    # ---- SGLang's allocator interface ------------------------------------------------------

    @property
    def dead_slot(self) -> int:
        """The reserved DEAD slot id (the highest slot, ``size``)."""
        return self.size

    def clear(self) -> None:
        super().clear()
        self.free_pages = self.free_pages[self.free_pages != self.dead_slot]
        n = self.size + 1
        self.refs = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.tree_refs = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.pins = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._version = 0  # bumped by every change of counts; keys the cached sizes
        self._sizes: tuple[int, tuple[int, int]] | None = None

    #: check every allocation against the counts (a host sync per call: tests and debugging;
    #: ``AGENTKV_SGLANG_STRICT=1``). Off, ``alloc`` only queues one index_put on the device.
    strict: bool = os.environ.get("AGENTKV_SGLANG_STRICT") == "1"

    def alloc(self, need_size: int):
        select = super().alloc(need_size)
        if select is not None and select.numel():
            if self.strict and bool((self.refs[select] != 0).any()):
                raise SlotRefcountError("allocator handed out a slot that is still referenced")
            # no version bump: a slot held by a request alone is neither evictable nor
            # protected, so the cached sizes stay right (and decode steps need no host sync)
            self.refs[select] = 1
        return select

    def free(self, free_index: torch.Tensor) -> None:
        """Drop one request reference on each slot (DEAD ignored); slots reaching 0 are freed."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:  # freed at free_group_end, through this method
            self.free_group.append(free_index)
            return
        self._release(self._decref(free_index, tree=False))

    # ---- tree references ---------------------------------------------------------------------

    def tree_incref(self, slots: torch.Tensor) -> None:
        """A radix-tree node now holds ``slots`` (int ``[n]``; DEAD ignored)."""
        s = self._live(slots)
        if s.numel() == 0:
            return
        if bool((self.refs[s] <= 0).any()):
            raise SlotRefcountError("a tree node took a reference on a free slot")
        ones = torch.ones_like(s, dtype=torch.int32)
        self.refs.index_add_(0, s, ones)
        self.tree_refs.index_add_(0, s, ones)
        self._version += 1

    def tree_decref(self, slots: torch.Tensor) -> int:
        """A radix-tree node let go of ``slots``; returns how many slots went back to the free
        list."""
        if slots.numel() == 0:
            return 0
        released = self._decref(slots, tree=True)
        self._release(released)
        return int(released.numel())

    def pin(self, slots: torch.Tensor, delta: int) -> None:
        """A tree node holding ``slots`` was locked (``+1``) or unlocked (``-1``)."""
        s = self._live(slots)
        if s.numel():
            self.pins.index_add_(0, s, torch.full_like(s, delta, dtype=torch.int32))
            self._version += 1

    # ---- accounting --------------------------------------------------------------------------

    def physical_sizes(self) -> tuple[int, int]:
        """``(evictable, protected)`` in slots: held only by unlocked tree nodes / by a locked
        tree node and no request (DEAD counted as protected, so ``available + evictable +
        protected == size`` when no request holds a slot, SGLang's idle invariant). Cached until
        the counts change (the scheduler asks several times per step)."""
        if self._sizes is not None and self._sizes[0] == self._version:
            return self._sizes[1]
        tree_only = (self.refs > 0) & (self.refs == self.tree_refs)
        evictable = int((tree_only & (self.pins == 0)).sum())
        protected = int((tree_only & (self.pins > 0)).sum()) + 1
        self._sizes = (self._version, (evictable, protected))
        return evictable, protected

    def used_slots(self) -> int:
        """Slots with at least one reference."""
        return int((self.refs > 0).sum())

    def check(self) -> None:
        """Recount: no negative count, free list == unreferenced slots (DEAD and 0 excluded),
        no duplicate in the free list. Raises :class:`SlotRefcountError`."""
        if bool((self.refs < 0).any() | (self.tree_refs < 0).any() | (self.pins < 0).any()):
            raise SlotRefcountError("negative reference count")
        if bool((self.tree_refs > self.refs).any()):
            raise SlotRefcountError("more tree references than references")
        free = torch.cat((self.free_pages, self.release_pages))
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

    # ---- internals ---------------------------------------------------------------------------

    def _release(self, slots: torch.Tensor) -> None:
        """Put slots whose count reached 0 on the free list now. Not through SGLang's ``free``:
        inside a free group (SGLang's decode-result step) that would queue them for
        ``free_group_end``, which calls :meth:`free` and would count them down a second time."""
        if slots.numel() == 0:
            return
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, slots))
        else:
            self.free_pages = torch.cat((self.free_pages, slots))

    def _live(self, slots: torch.Tensor) -> torch.Tensor:
        s = slots.reshape(-1).to(device=self.refs.device, dtype=torch.int64)
        return s[(s != self.dead_slot) & (s != 0)]

    def _decref(self, slots: torch.Tensor, tree: bool) -> torch.Tensor:
        s = self._live(slots)
        if s.numel() == 0:
            return s
        minus = torch.full_like(s, -1, dtype=torch.int32)
        self._version += 1
        self.refs.index_add_(0, s, minus)
        if tree:
            self.tree_refs.index_add_(0, s, minus)
        if bool((self.refs[s] < 0).any()) or (tree and bool((self.tree_refs[s] < 0).any())):
            raise SlotRefcountError(f"slot freed more often than referenced: {s.tolist()[:8]}")
        gone = torch.unique(s[self.refs[s] == 0])
        return gone.to(self.free_pages.dtype)
