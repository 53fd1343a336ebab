"""Per-request slot map: logical position -> KV slot, plus an optional per-(layer, head) mask.

The counterpart of one row of SGLang's ``req_to_token``: one slot per logical position, the
same slot for every layer (a pool row holds all heads of a token of every layer's buffer).
Eviction never moves anything: a position evicted everywhere is redirected to DEAD; a
position evicted in only some layers / KV heads keeps its slot and loses its bits in
``keep_mask``. Token ids, positions (hence RoPE phases) and surviving slots never change.

The map is plain data. It holds one reference on each non-DEAD slot it contains, but the
counting itself is the allocator's: the evict methods return the slots whose reference this
map just dropped, and the caller (``KVStore``) passes them to ``SlotAllocator.decref``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentkv.cache.dead_slot import DEAD


class SlotMap:
    """Logical position -> slot map of one request.

    Args:
        num_layers: ``L``.
        num_kv_heads: ``Hkv``.
        slots: optional initial map, int64 ``[T]`` (may contain DEAD, e.g. from a prefix-cache
            match with holes).
        keep_mask: optional bool ``[L, Hkv, T]`` for the initial map; ``None`` means every
            (layer, head) of every non-DEAD position is live.

    Invariant: ``slots[p] == DEAD`` exactly when no (layer, head) of ``p`` is live.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        slots: torch.Tensor | None = None,
        keep_mask: torch.Tensor | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        init = torch.empty(0, dtype=torch.int64) if slots is None else slots.to("cpu", torch.int64)
        self._len = int(init.numel())
        self._slots = torch.empty(max(16, self._len), dtype=torch.int64)
        self._slots[: self._len] = init.reshape(-1)
        self._mask: torch.Tensor | None = None
        if keep_mask is not None:
            if tuple(keep_mask.shape) != (num_layers, num_kv_heads, self._len):
                raise ValueError(
                    f"keep_mask must be [{num_layers}, {num_kv_heads}, {self._len}], "
                    f"got {list(keep_mask.shape)}"
                )
            self._ensure_mask()
            assert self._mask is not None
            self._mask[:, :, : self._len] = keep_mask.to("cpu", torch.bool)
        self._sync_dead_into_mask()

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return self._len

    @property
    def slots(self) -> torch.Tensor:
        """int64 ``[T]``: slot of each logical position, DEAD where evicted (a view)."""
        return self._slots[: self._len]

    @property
    def keep_mask(self) -> torch.Tensor | None:
        """bool ``[L, Hkv, T]`` live bits (a view), or ``None`` when no head was ever evicted
        separately (then every non-DEAD position is live in every layer and head)."""
        return None if self._mask is None else self._mask[:, :, : self._len]

    def resident(self) -> torch.Tensor:
        """bool ``[T]``: positions that hold a slot (not DEAD)."""
        return self.slots != DEAD

    def held_slots(self) -> torch.Tensor:
        """int64 ``[num_resident]``: the slots this map holds a reference on, in position order."""
        s = self.slots
        return s[s != DEAD].clone()

    @property
    def num_resident(self) -> int:
        """Positions holding a slot: memory this request keeps (shared slots included)."""
        return int((self.slots != DEAD).sum())

    @property
    def num_dead(self) -> int:
        """Positions redirected to DEAD."""
        return self._len - self.num_resident

    def live_entries(self) -> int:
        """Live (layer, KV head, position) entries: ``keep_mask.sum()``, or
        ``num_resident * L * Hkv`` without a mask."""
        if self._mask is None:
            return self.num_resident * self.num_layers * self.num_kv_heads
        return int(self.keep_mask.sum())  # type: ignore[union-attr]

    def effective_live_tokens(self) -> float:
        """Mask-weighted live tokens: ``live_entries / (L * Hkv)``."""
        return self.live_entries() / (self.num_layers * self.num_kv_heads)

    def intact_prefix_len(self) -> int:
        """Length of the leading run of positions with no hole (not DEAD, every head live).

        These positions were computed with the whole earlier context visible, so their K/V is
        exactly what an un-evicted request would hold: safe to share across sessions.
        """
        bad = self.slots == DEAD
        if self._mask is not None:
            bad = bad | ~self.keep_mask.all(dim=1).all(dim=0)  # type: ignore[union-attr]
        idx = torch.nonzero(bad)
        return self._len if idx.numel() == 0 else int(idx[0, 0])

    def layer_live(self, layer: int) -> torch.Tensor:
        """bool ``[T]``: positions with at least one live KV head in ``layer``."""
        if self._mask is None:
            return self.resident()
        return self.keep_mask[layer].any(dim=0)  # type: ignore[index]

    # ------------------------------------------------------------- mutation
    def append(self, slots: torch.Tensor) -> None:
        """Add positions ``T .. T+n-1`` mapped to ``slots`` (int64 ``[n]``, no DEAD), live in
        every layer and head. The caller hands this map its reference on each slot."""
        s = slots.to("cpu", torch.int64).reshape(-1)
        if bool((s == DEAD).any()):
            raise ValueError("append() takes real slots; DEAD only enters a map by eviction")
        n = int(s.numel())
        self._reserve(self._len + n)
        self._slots[self._len : self._len + n] = s
        if self._mask is not None:
            self._mask[:, :, self._len : self._len + n] = True
        self._len += n

    def evict(self, positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Evict ``positions`` (int64 ``[k]``, any order, repeats and already-dead ones allowed)
        in every layer and head: ``map[p] = DEAD``.

        Returns int64 ``[m]``: the slots that lost this map's reference (one per position that
        was resident), for the caller to ``decref``.
        """
        pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).unique()
        if pos.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        if int(pos.min()) < 0 or int(pos.max()) >= self._len:
            raise IndexError(f"positions must be in [0, {self._len}), got {pos.tolist()[:8]}...")
        old = self._slots[pos]
        released = old[old != DEAD].clone()
        self._slots[pos] = DEAD
        if self._mask is not None:
            self._mask[:, :, pos] = False
        return released

    def evict_heads(self, keep_mask: torch.Tensor) -> torch.Tensor:
        """Evict per (layer, KV head): ``keep_mask`` bool ``[L, Hkv, T']`` with ``T' <= T``;
        ``False`` evicts that entry, ``True`` keeps it if it is still live (nothing comes back).
        Positions ``>= T'`` are untouched. A position left with no live entry becomes DEAD.

        Returns int64 ``[m]``: the slots that lost this map's reference.
        """
        L, H = self.num_layers, self.num_kv_heads
        if keep_mask.dim() != 3 or tuple(keep_mask.shape[:2]) != (L, H):
            raise ValueError(f"keep_mask must be [{L}, {H}, T'], got {list(keep_mask.shape)}")
        t = int(keep_mask.shape[2])
        if t > self._len:
            raise ValueError(f"keep_mask covers {t} positions but the map has {self._len}")
        self._ensure_mask()
        assert self._mask is not None
        self._mask[:, :, :t] &= keep_mask.to("cpu", torch.bool)
        now_dead = ~self._mask[:, :, :t].any(dim=1).any(dim=0) & (self._slots[:t] != DEAD)
        released = self._slots[:t][now_dead].clone()
        self._slots[:t][now_dead] = DEAD
        return released

    def clone(self) -> SlotMap:
        """Independent copy (references are not copied: the caller accounts for them)."""
        return SlotMap(self.num_layers, self.num_kv_heads, self.slots.clone(), self.keep_mask)

    # -------------------------------------------------------------- private
    def _reserve(self, n: int) -> None:
        cap = int(self._slots.numel())
        if n <= cap:
            return
        new_cap = max(n, 2 * cap)
        grown = torch.empty(new_cap, dtype=torch.int64)
        grown[: self._len] = self._slots[: self._len]
        self._slots = grown
        if self._mask is not None:
            m = torch.ones(self.num_layers, self.num_kv_heads, new_cap, dtype=torch.bool)
            m[:, :, : self._len] = self._mask[:, :, : self._len]
            self._mask = m

    def _ensure_mask(self) -> None:
        if self._mask is None:
            cap = int(self._slots.numel())
            self._mask = torch.ones(self.num_layers, self.num_kv_heads, cap, dtype=torch.bool)
            self._mask[:, :, : self._len] = (self._slots[: self._len] != DEAD).view(1, 1, -1)

    def _sync_dead_into_mask(self) -> None:
        """Check the invariant for an initial (slots, mask) pair; clear mask bits of DEAD."""
        if self._mask is None:
            return
        m = self._mask[:, :, : self._len]
        m &= (self.slots != DEAD).view(1, 1, -1)
        if bool((~m.any(dim=1).any(dim=0) & (self.slots != DEAD)).any()):
            raise ValueError("a position with no live (layer, head) must map to DEAD")
