"""The reserved dead slot.

Row 0 of every full-precision pool is the dead slot (one constant, defined by
:mod:`agentkv.kernels.pools`). It is never handed out, never freed, and attention never reads
it: evicting position ``p`` in column (layer, KV head) ``c`` is ``slot_map[c, p] = DEAD``, and
both the attention metadata and the kernels drop DEAD entries by id (no K value can stand in
for a mask, since ``q . k`` takes either sign).

The SGLang extension cannot use SGLang's slot 0 for it (padded batch entries write there), so
it reserves another slot of SGLang's pool as its DEAD (``docs/sglang.md``).
"""

from __future__ import annotations

import torch

from agentkv.kernels.pools import DEAD

__all__ = ["DEAD", "live_slots"]


def live_slots(slots: torch.Tensor) -> torch.Tensor:
    """Return the entries of ``slots`` (int64 ``[n]``) that are not DEAD, in order."""
    return slots[slots != DEAD]
