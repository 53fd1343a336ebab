"""One extend batch's query sums: every ``sums_queries`` observer of the batch (IntentKV's
mean query) fed by one gather and one ``index_add_`` per layer.

Calling each request's :meth:`~agentkv.methods.base.PrefillObserver.observe` costs about a
dozen small launches per request and layer (selection masks, products, sums), ~0.3 ms of
the scheduler thread each: on a 36-layer model with a handful of requests per extend batch,
that host time, not the GPU, set the pace of the prefill (H100, session 10: 2.2 ms per layer
call at ~7 requests per batch). Here the rows each observer wants summed are worked out on
the host once per batch (:meth:`~agentkv.methods.base.PrefillObserver.query_sum_masks`, from
host-known positions: no device read), sent once, and each layer adds its queries into one
``[A, Hq·D]`` float32 buffer whatever the number of requests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from agentkv.methods.base import PrefillObserver


@dataclass
class QuerySumBatch:
    """The query sums of one extend batch.

    Attributes:
        observers: per observer, ``(observer, first, counts)``: its sums are rows
            ``first : first + len(counts)`` of :attr:`sums`; ``counts`` int64 ``[S]`` (CPU).
        rows: int64 ``[M]``, batch token rows to add (on the queries' device).
        dest: int64 ``[M]``, the sum each of :attr:`rows` goes to.
        sums: float32 ``[L, A, Hq·D]``, per layer the ``A`` sums of the batch.
        num_q_heads, head_dim: ``Hq``, ``D``.
        stream: the CUDA stream the forward runs on (None on the CPU): the sums are handed
            to the observers on it, after the layers' additions.
    """

    observers: list[tuple[PrefillObserver, int, torch.Tensor]]
    rows: torch.Tensor
    dest: torch.Tensor
    sums: torch.Tensor
    num_q_heads: int
    head_dim: int
    stream: torch.cuda.Stream | None

    @classmethod
    def build(
        cls,
        entries: list[tuple[PrefillObserver, int, torch.Tensor]],
        num_layers: int,
        num_q_heads: int,
        head_dim: int,
        device: torch.device,
    ) -> QuerySumBatch | None:
        """From ``(observer, first batch row, int64 positions [n] on the CPU)`` per observed
        request (its rows are ``first : first + n``); None when no row is summed. Call it on
        the forward's stream (the index copy is queued there, not waited for)."""
        rows: list[torch.Tensor] = []
        dest: list[torch.Tensor] = []
        observers = []
        a = 0
        for observer, first, positions in entries:
            masks = observer.query_sum_masks(positions)  # bool [S, n]
            for s in range(masks.shape[0]):
                r = torch.nonzero(masks[s]).reshape(-1)
                rows.append(r + first)
                dest.append(torch.full_like(r, a + s))
            observers.append((observer, a, masks.sum(dim=1)))
            a += masks.shape[0]
        if not rows or sum(r.numel() for r in rows) == 0:
            return None
        index = torch.stack((torch.cat(rows), torch.cat(dest)))  # int64 [2, M], CPU
        stream = None
        if device.type == "cuda":  # pinned + non_blocking: queued, the host does not wait
            index = index.pin_memory().to(device, non_blocking=True)
            stream = torch.cuda.current_stream(device)
        else:
            index = index.to(device)
        sums = torch.zeros(num_layers, a, num_q_heads * head_dim, device=device)
        return cls(observers, index[0], index[1], sums, num_q_heads, head_dim, stream)

    def observe(self, layer: int, q: torch.Tensor) -> None:
        """Add layer ``layer``'s post-RoPE queries (``[N, Hq·D]`` or ``[N, Hq, D]``, the
        batch's rows) into its sums."""
        picked = q.reshape(q.shape[0], -1).index_select(0, self.rows)
        self.sums[layer].index_add_(0, self.dest, picked.float())

    def finish(self) -> None:
        """Hand every observer its sums (``[L, S, Hq, D]``), queued on the forward's stream."""
        view = self.sums.view(self.sums.shape[0], -1, self.num_q_heads, self.head_dim)
        on = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with on:
            for observer, first, counts in self.observers:
                observer.add_query_sums(view[:, first : first + counts.numel()], counts)
