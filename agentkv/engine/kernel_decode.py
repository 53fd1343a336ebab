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
from agentkv.kernels import SegmentMaxLens, decode_attention
from agentkv.kernels.backend import Backend

#: positions of slack in the plan's bounds of the quantized segments (a multiple of the INT2
#: page): a bound past a segment's length costs programs that end at once (at most 512
#: positions' worth: an eighth at 4k, 1.6% at 32k)
BOUND_SLACK = 512


def _round_up(n: int) -> int:
    return -(-n // BOUND_SLACK) * BOUND_SLACK


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
        self.appended = 0  # decode steps appended (the room a rebuilt index still needs)
        #: INT4 cells moved by this decode's compactions
        self.compacted = store.compact_int4(req).cells_moved
        self.index = self._build()
        #: the host bounds the kernels are planned with: the index's, rounded up
        self.bounds = SegmentMaxLens(0, 0, 0)
        #: bumps whenever a step's launches change (a new index, or bounds that grew past
        #: their slack): what a captured step (:class:`DecodeGraph`) replays is valid within
        #: one epoch
        self.epoch = 0
        self._plan_bounds(keep=False)

    def _build(self) -> DecodeIndex:
        """A new index of the request's map, with room for the decode steps still to come."""
        room = self.room - self.appended
        return DecodeIndex.build(self.req.slot_map, self.store.layout, room, self.store.pool.device)

    def rebuild(
        self, page: tuple[int, int] | None = None, dropped: torch.Tensor | None = None
    ) -> None:
        """Bring the index up to the slot map after a precision change or an eviction,
        first moving the request's INT4 cells that eviction left sparse into fuller runs
        (:meth:`KVStore.compact_int4`: the kernel reads consecutive rows faster). The index
        follows in place where it can: ``page``, positions ``page[0] .. page[1] - 1`` went to
        INT4 since it was built (a decode-time page: :meth:`DecodeIndex.advance`,
        ``O(page)``); ``dropped``, the cells an eviction released (int64 ``[L * Hkv, n]``,
        a decode-time pruning pass: :meth:`DecodeIndex.drop`). Else (or with both) it is
        rebuilt.

        A rebuilt index is written into the current one's buffers where it fits
        (:meth:`DecodeIndex.refill`), and the bounds stay while they still cover it, loose
        by at most ``2 * BOUND_SLACK`` positions: a captured step then replays on."""
        moved = self.store.compact_int4(self.req).cells_moved
        self.compacted += moved
        followed = False
        if not moved and dropped is not None and page is None:
            self.index.drop(dropped, self.store.layout.num_ids)
            followed = True
        elif not moved and page is not None and dropped is None:
            followed = self.index.advance(self.req.slot_map, self.store.layout, *page)
        if followed:
            self._plan_bounds(keep=True)
            return
        index = self._build()
        keep = self.index.refill(index)
        if not keep:
            self.index = index
        self._plan_bounds(keep)

    def _plan_bounds(self, keep: bool) -> None:
        """Bounds for the kernels' plan from the index's: the quantized segments' rounded
        up to :data:`BOUND_SLACK` positions (a decode-time page grows one by 32; the plan,
        and a captured step, then hold for 16 pages), the full segment's as they are (it
        already has room for every decode step, and only shrinks). ``keep``: the index's
        buffers are the ones the current bounds were planned for; the bounds (and the epoch)
        stay where each still covers its segment, loose by at most ``2 * BOUND_SLACK``
        positions (a program past its column's end returns at once)."""
        b, cur = self.index.max_lens, self.bounds
        if keep and all(
            need <= have <= need + 2 * BOUND_SLACK
            for need, have in ((b.int2, cur.int2), (b.int4, cur.int4), (b.full, cur.full))
        ):
            return
        self.bounds = SegmentMaxLens(_round_up(b.int2), _round_up(b.int4), b.full)
        self.epoch += 1

    def append(self, cells: torch.Tensor) -> None:
        """A decode step's new cells (int64 ``[L * Hkv, 1]``) join every column."""
        self.index.append(cells)
        self.appended += 1

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
            max_lens=self.bounds,
            backend=self.backend,
        )
        return out[:, None]
