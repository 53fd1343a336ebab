"""Decode-kernel metadata of one request: per (layer, KV head), its cells in segment order.

:func:`agentkv.kernels.decode_attention` reads, per KV head, INT2 rows first (whole 32-row
pages, each in an aligned 32-entry block, DEAD where a page row was evicted), then INT4 rows
(in row order: the kernel reads consecutive rows of a head-major pool faster), then
full-precision rows; DEAD cells are dropped (the kernel also masks them by id).
Attention is order-free over keys (RoPE is already in K), so this reordering changes
nothing, while slot ids never move. Built once per decode phase from the slot map (and again
after a precision change); each decode step appends its new full-precision cells in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.cache.dead_slot import DEAD
from agentkv.cache.slot_allocator import PoolLayout
from agentkv.cache.slot_map import SlotMap
from agentkv.kernels import INT2_PAGE, SegmentMaxLens


@dataclass
class DecodeIndex:
    """Per-layer decode metadata (tensors on the pool device).

    Attributes:
        slot_map: int32 ``[L, Hkv, cap]`` cells in segment order (garbage past ``seq_lens``).
        seq_lens: int32 ``[L, Hkv]`` entries used per column.
        int2_lens: int32 ``[L, Hkv]`` INT2 segment length (multiple of 32).
        int4_lens: int32 ``[L, Hkv]`` INT4 segment length.
        max_lens: host bounds of the segment lengths over all columns (grid sizes).
        longest: host copy of ``seq_lens.max()``.
    """

    slot_map: torch.Tensor
    seq_lens: torch.Tensor
    int2_lens: torch.Tensor
    int4_lens: torch.Tensor
    max_lens: SegmentMaxLens
    longest: int

    @classmethod
    def build(
        cls, slot_map: SlotMap, layout: PoolLayout, room: int, device: torch.device | str
    ) -> DecodeIndex:
        """Index of ``slot_map`` with ``room`` free entries per column for decode steps."""
        L, H = slot_map.num_layers, slot_map.num_kv_heads
        cells = slot_map.slots  # [C, T]
        C = cells.shape[0]
        is2 = cells >= layout.int2_base
        is4 = (cells >= layout.int4_base) & ~is2
        isf = (cells != DEAD) & (cells < layout.int4_base)
        rows: list[torch.Tensor] = []
        n2s, n4s, nfs = [], [], []
        for c in range(C):
            row = cells[c]
            ids2 = row[is2[c]]
            if ids2.numel():
                page = (ids2 - layout.int2_base) // INT2_PAGE
                uniq, rank = torch.unique(page, return_inverse=True)
                seg2 = torch.full((int(uniq.numel()) * INT2_PAGE,), DEAD, dtype=torch.int64)
                seg2[rank * INT2_PAGE + (ids2 - layout.int2_base) % INT2_PAGE] = ids2
            else:
                seg2 = row[:0]
            # INT4 cells in row order: a span demoted in one go already is (the allocator
            # hands out runs); spans demoted apart interleave into runs here
            seg4, segf = row[is4[c]].sort().values, row[isf[c]]
            rows.append(torch.cat([seg2, seg4, segf]))
            n2s.append(int(seg2.numel()))
            n4s.append(int(seg4.numel()))
            nfs.append(int(segf.numel()))
        cap = max((int(r.numel()) for r in rows), default=0) + max(room, 1)
        sm = torch.zeros(C, cap, dtype=torch.int32)
        for c, r in enumerate(rows):
            sm[c, : r.numel()] = r.to(torch.int32)
        n2 = torch.tensor(n2s, dtype=torch.int32)
        n4 = torch.tensor(n4s, dtype=torch.int32)
        nf = torch.tensor(nfs, dtype=torch.int32)
        lens = n2 + n4 + nf
        bounds = SegmentMaxLens(int(n2.max()), int(n4.max()), int(nf.max()) + max(room, 1))
        return cls(
            sm.view(L, H, cap).to(device),
            lens.view(L, H).to(device),
            n2.view(L, H).to(device),
            n4.view(L, H).to(device),
            bounds,
            int(lens.max()) if lens.numel() else 0,
        )

    def append(self, cells: torch.Tensor) -> None:
        """Add one full-precision cell per column (int64 ``[L * Hkv, 1]``, from
        ``KVStore.extend``) at the end of each column's list."""
        L, H, cap = self.slot_map.shape
        new = cells.reshape(L, H).to(self.slot_map.device, torch.int32)
        if self.longest >= cap:
            raise RuntimeError("decode index is full: rebuild it with more room")
        self.slot_map.scatter_(2, self.seq_lens.long()[:, :, None], new[:, :, None])
        self.seq_lens += 1
        self.longest += 1
