"""The reserved dead slot.

Row 0 of every KV pool is the dead slot. It is reserved when the allocator starts, is never
handed out and never freed, and attention never reads it: evicting logical position ``p`` of a
request is ``slot_map[p] = DEAD``, and the attention metadata drops DEAD entries from the index
list (no K value can stand in for a mask, since ``q . k`` takes either sign).

This is SGLang's own padded slot 0 (``TokenToKVPoolAllocator`` hands out ``1..size``), so the
SGLang extension maps DEAD onto it one to one.
"""

from __future__ import annotations

from typing import Final

import torch

DEAD: Final[int] = 0
"""Slot id of the dead slot (row 0 of every pool buffer)."""


def live_slots(slots: torch.Tensor) -> torch.Tensor:
    """Return the entries of ``slots`` (int64 ``[n]``) that are not DEAD, in order."""
    return slots[slots != DEAD]
