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
        # every column at once, on the index's device (a loop over columns cost 13 ms at
        # SmolLM2's 90 columns x 4k positions and 0.25 s at 288 x 32k on the CPU, and a
        # build follows every decode-time page); ids fit int32, the copy is half as big
        cells = slot_map.slots.to(torch.int32).to(device)  # [C, T]
        C = cells.shape[0]
        is2 = cells >= layout.int2_base
        is4 = (cells >= layout.int4_base) & ~is2
        isf = (cells != DEAD) & (cells < layout.int4_base)
        # INT2: each column's pages in page order, a page's rows at their offsets in it
        c2, p2 = torch.nonzero(is2, as_tuple=True)
        off2 = (cells[c2, p2] - layout.int2_base).long()
        per = max(layout.int2_pages, 1)
        pages, inv = torch.unique(c2 * per + off2 // INT2_PAGE, return_inverse=True)
        npages = torch.bincount(pages // per, minlength=C)
        rank2 = inv - (torch.cumsum(npages, 0) - npages)[c2]
        n2 = npages * INT2_PAGE
        # INT4 cells in row order: a span demoted in one go already is (the allocator
        # hands out runs); spans demoted apart interleave into runs here
        c4, p4 = torch.nonzero(is4, as_tuple=True)
        key4 = torch.sort(c4 * layout.num_ids + cells[c4, p4]).values
        c4, id4 = key4 // layout.num_ids, key4 % layout.num_ids
        n4 = torch.bincount(c4, minlength=C)
        rank4 = torch.arange(c4.numel(), device=cells.device) - (torch.cumsum(n4, 0) - n4)[c4]
        # full cells in position order (nonzero lists them so, column by column)
        cf, pf = torch.nonzero(isf, as_tuple=True)
        nf = torch.bincount(cf, minlength=C)
        rankf = torch.arange(cf.numel(), device=cells.device) - (torch.cumsum(nf, 0) - nf)[cf]
        lens = n2 + n4 + nf
        n_max = torch.stack([lens.max(), n2.max(), n4.max(), nf.max()]).tolist() if C else [0] * 4
        cap = n_max[0] + max(room, 1)
        # (DEAD where an INT2 row is gone, and past each column's length)
        sm = torch.full((C * cap,), DEAD, dtype=torch.int32, device=cells.device)
        sm[c2 * cap + rank2 * INT2_PAGE + off2 % INT2_PAGE] = (off2 + layout.int2_base).int()
        sm[c4 * cap + n2[c4] + rank4] = id4.int()
        sm[cf * cap + n2[cf] + n4[cf] + rankf] = cells[cf, pf]
        n2, n4, lens = n2.int(), n4.int(), lens.int()
        bounds = SegmentMaxLens(n_max[1], n_max[2], n_max[3] + max(room, 1))
        return cls(
            sm.view(L, H, cap),
            lens.view(L, H),
            n2.view(L, H),
            n4.view(L, H),
            bounds,
            n_max[0],
        )

    def refill(self, new: DecodeIndex) -> bool:
        """Take ``new``'s contents (an index of the same request, built after an eviction or
        a precision change) into this index's buffers, whose addresses stay (a captured decode
        step reads them). False, changing nothing, where ``new``'s rows are longer than these
        buffers' (or another shape)."""
        L, H, cap = self.slot_map.shape
        nl, nh, ncap = new.slot_map.shape
        if (nl, nh) != (L, H) or ncap > cap or new.slot_map.device != self.slot_map.device:
            return False
        self.slot_map[:, :, :ncap].copy_(new.slot_map)
        self.slot_map[:, :, ncap:].fill_(DEAD)  # (as a build leaves every column's end)
        self.seq_lens.copy_(new.seq_lens)
        self.int2_lens.copy_(new.int2_lens)
        self.int4_lens.copy_(new.int4_lens)
        self.max_lens, self.longest = new.max_lens, new.longest
        return True

    def drop(self, cells: torch.Tensor, num_ids: int) -> None:
        """Remove ``cells`` (int64 ``[L * Hkv, n]``: per column, cells the request's map no
        longer holds, DEAD as padding: what an eviction released) in place, without a
        rebuild: an INT2 entry turns DEAD (its page stays whole and aligned), INT4 and full
        entries leave their segments and the rest of the column moves up, in order.
        ``O(columns x cap)`` on the index's device, nothing read back; ``max_lens`` and
        ``longest`` stay upper bounds. ``num_ids``: the pool layout's id count."""
        L, H, cap = self.slot_map.shape
        C = L * H
        dev = self.slot_map.device
        rows = self.slot_map.view(C, cap)
        c = cells.reshape(C, -1).to(dev, torch.int64)
        col = torch.arange(C, device=dev, dtype=torch.int64)[:, None]
        want = (col * num_ids + c)[c != DEAD]
        j = torch.arange(cap, device=dev)[None, :]
        lens = self.seq_lens.reshape(C, 1)
        hit = torch.isin(col * num_ids + rows, want) & (j < lens) & (rows != DEAD)
        n2 = self.int2_lens.reshape(C, 1)
        rows.masked_fill_(hit & (j < n2), DEAD)  # (INT2 rows: DEAD inside their page)
        gone = hit & (j >= n2)
        # kept entries first, in order (a stable sort on "gone"); then DEAD past the end
        order = torch.sort(gone.to(torch.int8), dim=1, stable=True).indices
        rows.copy_(rows.gather(1, order))
        lens -= gone.sum(dim=1, keepdim=True, dtype=torch.int32)
        rows.masked_fill_(j >= lens, DEAD)
        in4 = (j < n2 + self.int4_lens.reshape(C, 1)) & gone
        self.int4_lens -= in4.sum(dim=1, dtype=torch.int32).view_as(self.int4_lens)

    def advance(self, slot_map: SlotMap, layout: PoolLayout, start: int, end: int) -> bool:
        """Follow a decode-time page in place instead of a rebuild: positions ``start ..
        end - 1`` of ``slot_map`` were full precision in this index (built or advanced from
        it, decode steps appended since) and have just been demoted, all to INT4 or all to
        whole INT2 pages, nothing else changed. Each column's window cells then head its
        full segment (positions before the window hold none: checked), so they leave it: INT4
        ids overwrite those entries and the INT4 segment grows over them (``O(page)``); INT2
        pages join the INT2 segment's end in aligned blocks and the INT4 segment shifts past
        them on the index's device (``O(columns x length)`` there, ``O(page)`` on the host).
        Returns False, changing nothing, where that does not hold (a window cell still full
        precision, INT4 and INT2 mixed, a page not whole, a quantized cell after the window,
        full cells before it): rebuild."""
        s = slot_map.slots
        if end <= start or end > s.shape[1]:
            return False
        win, tail = s[:, start:end], s[:, end:]
        live = win != DEAD
        is2 = win >= layout.int2_base
        is4 = (win >= layout.int4_base) & ~is2
        tail_live = tail != DEAD
        if bool((live & ~(is4 | is2)).any()) or bool(
            (tail_live & (tail >= layout.int4_base)).any()
        ):
            return False
        to2 = bool(is2.any())
        if to2 and bool(is4.any()):
            return False
        moved = is2 if to2 else is4
        k = moved.sum(dim=1)  # [C] window cells per column, now quantized
        cols, pos = torch.nonzero(moved, as_tuple=True)  # per column, in position order
        rank = torch.arange(cols.numel()) - (torch.cumsum(k, 0) - k)[cols]
        cells = win[cols, pos]
        if to2:  # whole pages: each block of 32 is one page's rows, in order
            row, off = cells - layout.int2_base, rank % INT2_PAGE
            page = torch.div(row, INT2_PAGE, rounding_mode="floor")
            first = torch.arange(cells.numel()) - off  # the block's first cell
            whole = (row % INT2_PAGE == off) & (page == page[first])
            if not bool((k % INT2_PAGE == 0).all()) or not bool(whole.all()):
                return False
        L, H, cap = self.slot_map.shape
        dev = self.slot_map.device
        n2, n4 = self.int2_lens.reshape(-1), self.int4_lens.reshape(-1)
        before = self.seq_lens.reshape(-1) - n2 - n4 - (k + tail_live.sum(dim=1)).to(dev)
        head = (n2 + n4).long()
        rows = self.slot_map.view(L * H, cap)
        # the entries that leave the full segment are full cells, none before the window
        at = torch.arange(end - start, device=dev)[None, :]
        old = rows.gather(1, (head[:, None] + at).clamp_max(cap - 1))
        mine = at < k.to(dev)[:, None]
        bad = (mine & ((old == DEAD) | (old >= layout.int4_base))).any() | (before != 0).any()
        if bool(bad):
            return False
        kd = k.to(dev)
        if to2:  # the INT4 segment moves k entries on, over the full entries that left
            j = torch.arange(cap, device=dev)[None, :]
            n2c = n2.long()[:, None]
            shift = (j >= n2c + kd[:, None]) & (j < head[:, None] + kd[:, None])
            rows.copy_(rows.gather(1, torch.where(shift, j - kd[:, None], j)))
            at_seg, lens = n2.long(), self.int2_lens
        else:
            at_seg, lens = head, self.int4_lens
        dst = cols.to(dev) * cap + at_seg[cols.to(dev)] + rank.to(dev)
        rows.view(-1)[dst] = cells.to(dev, torch.int32)
        lens += k.view(L, H).to(dev, torch.int32)
        b = self.max_lens  # (upper bounds still: a segment grew by k, the full one fell by k)
        grow, fall = int(k.max()), int(k.min())
        self.max_lens = (
            SegmentMaxLens(b.int2 + grow, b.int4, b.full - fall)
            if to2
            else SegmentMaxLens(b.int2, b.int4 + grow, b.full - fall)
        )
        return True

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
