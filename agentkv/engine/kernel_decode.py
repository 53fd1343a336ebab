"""Decode attention on the kernels: :func:`agentkv.kernels.decode_attention` reading the
store's mixed-precision pools through a per-(layer, KV head) :class:`DecodeIndex`.

The engine's attention seam has two implementations: the dense one (:class:`LiveView` in
:mod:`agentkv.engine.store_cache`: K/V gathered and dequantized once per phase, then torch
SDPA; prefill everywhere and decode on CPU) and this one (decode on CUDA: each step reads the
INT2 / INT4 / full cells in place, DEAD skipped by id, per-head holes honoured). Only these
two know about precision; the engine hands them cells.
"""

from __future__ import annotations

import torch

from agentkv.cache import DecodeIndex, KVStore, RequestKV
from agentkv.kernels import decode_attention
from agentkv.kernels.backend import Backend


class KernelDecode:
    """Per-request decode state for the fused decode kernel.

    Args:
        store: the engine's store.
        req: the request being decoded (its plan already applied).
        room: decode steps to make room for in the index.
        backend: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) or ``"torch"`` (the
            kernels' reference).
    """

    def __init__(self, store: KVStore, req: RequestKV, room: int, backend: Backend):
        self.store = store
        self.req = req
        self.room = room
        self.backend = backend
        self.compacted = 0  # INT4 cells moved by this decode's rebuilds
        self.rebuild()

    def rebuild(self, page: tuple[int, int] | None = None) -> None:
        """Rebuild the index from the slot map (after a precision change or an eviction),
        first moving the request's INT4 cells that eviction left sparse into fuller runs
        (:meth:`KVStore.compact_int4`: the kernel reads consecutive rows faster). ``page``:
        only positions ``page[0] .. page[1] - 1`` went to INT4 since the index was built (a
        decode-time page): the index follows in place where it can
        (:meth:`DecodeIndex.advance`, ``O(page)``), else it is rebuilt."""
        moved = self.store.compact_int4(self.req).cells_moved
        self.compacted += moved
        follow = page is not None and not moved
        if follow and self.index.advance(self.req.slot_map, self.store.layout, *page):
            return
        self.index = DecodeIndex.build(
            self.req.slot_map, self.store.layout, self.room, self.store.pool.device
        )

    def append(self, cells: torch.Tensor) -> None:
        """A decode step's new cells (int64 ``[L * Hkv, 1]``) join every column."""
        self.index.append(cells)

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """``query`` ``[1, Hq, 1, D]`` -> attention output ``[1, 1, Hq, D]``."""
        ix = self.index
        out = decode_attention(
            query[0, :, 0, :][None],
            self.store.pool.layers[layer],
            ix.slot_map[layer][None],
            ix.seq_lens[layer][None],
            int2_lens=ix.int2_lens[layer][None],
            int4_lens=ix.int4_lens[layer][None],
            sm_scale=scaling,
            max_lens=ix.max_lens,
            backend=self.backend,
        )
        return out[:, None]
