"""Reference-counted allocator of KV pool slots.

The counterpart of SGLang's ``TokenToKVPoolAllocator`` (page size 1): it hands out row indices
``1 .. num_slots - 1`` of the KV pool; row 0 is the dead slot (:data:`~agentkv.cache.DEAD`),
reserved at start-up and never handed out. Unlike SGLang, where the radix tree owns a slot
implicitly and requests free "their" part by position arithmetic, every holder of a slot here
holds a counted reference: each request slot map and each prefix-cache node that contains the
slot is one reference. A slot goes back to the free list exactly when its count reaches 0, so
aliasing (sibling requests sharing a prefix, a session's holes, an earlier round already
redirected to DEAD) never needs to be guessed.

Bookkeeping lives on the host (CPU tensors), whatever device the pool is on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentkv.cache.dead_slot import DEAD


class OutOfSlots(RuntimeError):
    """Raised when an allocation needs more free slots than there are."""


class SlotRefcountError(RuntimeError):
    """Raised on a reference-count violation: double free, a reference taken on a free slot,
    the dead slot passed where a real slot is needed, or a slot id out of range."""


def as_slot_tensor(slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Return ``slots`` as a 1-D int64 CPU tensor (no copy when it already is one)."""
    t = torch.as_tensor(slots, dtype=torch.int64)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1)


class SlotAllocator:
    """Hands out pool slots with reference counts.

    Args:
        num_slots: rows in the KV pool, dead slot included; ``capacity = num_slots - 1``
            slots can be handed out (SGLang's ``size``).

    Every slot is in exactly one of three states: the dead slot (never counted), free
    (count 0, on the free list) or in use (count >= 1).
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(
                f"num_slots must be >= 2 (one dead slot + one usable), got {num_slots}"
            )
        self.num_slots = int(num_slots)
        self._refcount = torch.zeros(self.num_slots, dtype=torch.int32)
        # Free list, front is handed out first; freed slots are pushed to the front, so a slot
        # freed too early is reused (and overwritten) quickly, which tests notice.
        self._free = torch.arange(1, self.num_slots, dtype=torch.int64)

    @property
    def capacity(self) -> int:
        """Slots that can ever be handed out (``num_slots - 1``; the dead slot is not)."""
        return self.num_slots - 1

    @property
    def free_count(self) -> int:
        """Slots on the free list now."""
        return int(self._free.numel())

    @property
    def used_count(self) -> int:
        """Slots with at least one reference (``capacity - free_count``)."""
        return self.capacity - self.free_count

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots, each with one reference (the caller's).

        Returns an int64 CPU tensor ``[n]`` of distinct slot ids, never DEAD.
        Raises :class:`OutOfSlots` when fewer than ``n`` slots are free (nothing is taken).
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self.free_count:
            raise OutOfSlots(
                f"need {n} KV slots but only {self.free_count} of {self.capacity} are free "
                f"({self.used_count} held by requests and the prefix cache)"
            )
        out, self._free = self._free[:n].clone(), self._free[n:]
        self._refcount[out] = 1
        return out

    def incref(self, slots: torch.Tensor | Sequence[int]) -> None:
        """Add one reference per entry of ``slots`` (int64 ``[n]``; repeats count twice).

        Every slot must be in use (count >= 1): a reference can only be copied from a holder.
        Raises :class:`SlotRefcountError` otherwise, or on DEAD / out-of-range ids.
        """
        s = self._checked(slots)
        if s.numel() == 0:
            return
        uniq, counts = torch.unique(s, return_counts=True)
        if bool((self._refcount[uniq] <= 0).any()):
            bad = uniq[self._refcount[uniq] <= 0].tolist()
            raise SlotRefcountError(f"incref of free slot(s) {bad[:8]}: take references by alloc()")
        self._refcount[uniq] += counts.to(torch.int32)

    def decref(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Drop one reference per entry of ``slots`` (int64 ``[n]``; repeats count twice).

        Slots whose count reaches 0 go back to the free list and are returned (int64 ``[m]``).
        Raises :class:`SlotRefcountError`, changing nothing, if a count would go negative
        (double free) or on DEAD / out-of-range ids.
        """
        s = self._checked(slots)
        if s.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        uniq, counts = torch.unique(s, return_counts=True)
        new = self._refcount[uniq] - counts.to(torch.int32)
        if bool((new < 0).any()):
            bad = uniq[new < 0].tolist()
            raise SlotRefcountError(f"double free of slot(s) {bad[:8]}")
        self._refcount[uniq] = new
        freed = uniq[new == 0]
        if freed.numel():
            self._free = torch.cat((freed, self._free))
        return freed

    def refcount(self, slots: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """Reference counts (int32), of ``slots`` or of every row (``[num_slots]``, row 0 is 0)."""
        if slots is None:
            return self._refcount.clone()
        return self._refcount[as_slot_tensor(slots)].clone()

    def free_slots(self) -> torch.Tensor:
        """The free list (int64 ``[free_count]``, a copy), for tests and debugging."""
        return self._free.clone()

    def _checked(self, slots: torch.Tensor | Sequence[int]) -> torch.Tensor:
        s = as_slot_tensor(slots)
        if s.numel() == 0:
            return s
        if bool((s == DEAD).any()):
            raise SlotRefcountError("the dead slot has no reference count; filter it out first")
        if int(s.min()) < 0 or int(s.max()) >= self.num_slots:
            raise SlotRefcountError(
                f"slot id out of range [1, {self.num_slots}): "
                f"min {int(s.min())}, max {int(s.max())}"
            )
        return s
