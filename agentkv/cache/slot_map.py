"""Per-request slot map: (layer, KV head) column x logical position -> KV cell.

The counterpart of one row of SGLang's ``req_to_token``, with one row per (layer, KV head)
column ``c = layer * Hkv + h``: ``slots[c, p]`` is the unified slot id (full / INT4 / INT2,
see :class:`agentkv.cache.PoolLayout`) holding position ``p`` of that column, or DEAD.
Each column is independent: a position evicted or demoted in one (layer, head) changes only
that column's cell, so its bytes go back to that column's free list. Token ids, positions
(hence RoPE phases) and surviving cells never move; a precision change replaces a cell id.

The map is plain data. It holds one reference on each non-DEAD cell; the counting itself is
the allocator's: mutators return the cells whose reference the map just dropped, and the
caller (``KVStore``) passes them to ``SlotAllocator.decref``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentkv.cache.dead_slot import DEAD


class SlotMap:
    """Column x position -> cell map of one request.

    Args:
        num_layers: ``L``.
        num_kv_heads: ``Hkv``.
        slots: optional initial map, int64 ``[L * Hkv, T]`` (DEAD allowed, e.g. from a
            prefix-cache match with holes).
        full_limit: first id that is not full precision (``PoolLayout.int4_base``); ids below
            it (and not DEAD) are full-precision cells.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        slots: torch.Tensor | None = None,
        full_limit: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_columns = num_layers * num_kv_heads
        self.full_limit = full_limit
        c = self.num_columns
        init = (
            torch.empty(c, 0, dtype=torch.int64)
            if slots is None
            else torch.as_tensor(slots).to("cpu", torch.int64)
        )
        if init.dim() != 2 or init.shape[0] != c:
            raise ValueError(f"slots must be [L*Hkv={c}, T], got {list(init.shape)}")
        self._len = int(init.shape[1])
        self._slots = torch.empty(c, max(16, self._len), dtype=torch.int64)
        self._slots[:, : self._len] = init

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self._len

    @property
    def slots(self) -> torch.Tensor:
        """int64 ``[L * Hkv, T]`` cells, DEAD where evicted (a view)."""
        return self._slots[:, : self._len]

    def layer_slots(self, layer: int) -> torch.Tensor:
        """int64 ``[Hkv, T]`` cells of ``layer`` (a view)."""
        h = self.num_kv_heads
        return self._slots[layer * h : (layer + 1) * h, : self._len]

    @property
    def keep_mask(self) -> torch.Tensor:
        """bool ``[L, Hkv, T]``: cells that are live (not DEAD)."""
        return (self.slots != DEAD).view(self.num_layers, self.num_kv_heads, self._len)

    def resident(self) -> torch.Tensor:
        """bool ``[T]``: positions with a live cell in at least one column."""
        return (self.slots != DEAD).any(dim=0)

    @property
    def num_resident(self) -> int:
        """Positions with at least one live cell."""
        return int(self.resident().sum())

    @property
    def num_dead(self) -> int:
        """Positions with no live cell in any column."""
        return self._len - self.num_resident

    def live_entries(self) -> int:
        """Live (column, position) cells."""
        return int((self.slots != DEAD).sum())

    def effective_live_tokens(self) -> float:
        """Live cells per column: ``live_entries / (L * Hkv)``."""
        return self.live_entries() / self.num_columns

    def full_precision(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """bool ``[L * Hkv, end - start]``: live cells at full precision among positions
        ``start .. end - 1`` (default: all)."""
        s = self._slots[:, start : self._len if end is None else min(end, self._len)]
        live = s != DEAD
        return live if self.full_limit is None else live & (s < self.full_limit)

    def intact_prefix_len(self) -> int:
        """Length of the leading run of positions live at full precision in every column.

        These positions hold exactly what an uncompressed request would: safe to share
        across sessions.
        """
        bad = ~self.full_precision().all(dim=0)
        idx = torch.nonzero(bad)
        return self._len if idx.numel() == 0 else int(idx[0, 0])

    # ------------------------------------------------------------- mutation
    def append(self, cells: torch.Tensor) -> None:
        """Add positions ``T .. T+n-1`` with cells int64 ``[L * Hkv, n]`` (no DEAD). The
        caller hands this map its reference on each cell."""
        s = torch.as_tensor(cells).to("cpu", torch.int64)
        if s.dim() != 2 or s.shape[0] != self.num_columns:
            raise ValueError(f"cells must be [{self.num_columns}, n], got {list(s.shape)}")
        if bool((s == DEAD).any()):
            raise ValueError("append() takes real cells; DEAD only enters a map by eviction")
        n = int(s.shape[1])
        self._reserve(self._len + n)
        self._slots[:, self._len : self._len + n] = s
        self._len += n

    def truncate(self, n: int) -> torch.Tensor:
        """Drop the last ``n`` positions. Returns their cells, int64 ``[L * Hkv, n]`` (DEAD
        where evicted), for the caller to ``decref``."""
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot drop {n} of {self._len} positions")
        dropped = self._slots[:, self._len - n : self._len].clone()
        self._len -= n
        return dropped

    def evict(self, positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Evict ``positions`` (int64 ``[k]``; repeats and dead ones allowed) in every column.

        Returns int64 ``[L * Hkv, k']``: the cells that lost this map's reference (DEAD where
        there was none), for the caller to ``decref``.
        """
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).unique()
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= self._len):
            raise IndexError(f"positions must be in [0, {self._len}), got {pos.tolist()[:8]}...")
        released = self._slots[:, pos].clone()
        self._slots[:, pos] = DEAD
        return released

    def evict_cells(self, keep: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Evict per column: ``keep`` bool ``[L, Hkv, T']`` (or ``[L * Hkv, T']``) over
        positions ``start .. start + T' - 1`` (within the map); ``False`` evicts that cell,
        ``True`` keeps it if live (nothing comes back). Other positions are untouched.

        Returns int64 ``[L * Hkv, T']``: cells that lost this map's reference (else DEAD).
        """
        lh = (self.num_layers, self.num_kv_heads)
        k = keep.reshape(self.num_columns, -1) if keep.dim() == 3 and keep.shape[:2] == lh else keep
        if k.dim() != 2 or k.shape[0] != self.num_columns:
            raise ValueError(
                f"keep must be [{self.num_layers}, {self.num_kv_heads}, T'], got {list(keep.shape)}"
            )
        t = int(k.shape[1])
        if start < 0 or start + t > self._len:
            raise ValueError(
                f"keep covers positions {start}..{start + t - 1} but the map has {self._len}"
            )
        k = k.to("cpu", torch.bool)
        view = self._slots[:, start : start + t]
        released = torch.where(k, torch.full_like(view, DEAD), view)
        view[~k] = DEAD
        return released

    def replace(
        self, cols: torch.Tensor, positions: torch.Tensor, cells: torch.Tensor
    ) -> torch.Tensor:
        """Point ``(cols[i], positions[i])`` at ``cells[i]`` (a precision change; the caller
        hands over the new references). Returns the old cells (int64 ``[m]``) whose reference
        this map dropped."""
        old = self._slots[cols, positions].clone()
        if bool((old == DEAD).any()):
            raise ValueError("replace() moves live cells only")
        self._slots[cols, positions] = cells
        return old

    def clone(self) -> SlotMap:
        """Independent copy (references are not copied: the caller accounts for them)."""
        return SlotMap(self.num_layers, self.num_kv_heads, self.slots.clone(), self.full_limit)

    # -------------------------------------------------------------- private
    def _reserve(self, n: int) -> None:
        cap = int(self._slots.shape[1])
        if n <= cap:
            return
        grown = torch.empty(self.num_columns, max(n, 2 * cap), dtype=torch.int64)
        grown[:, : self._len] = self._slots[:, : self._len]
        self._slots = grown
