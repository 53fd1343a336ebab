"""QueryMemory: IntentKV's per-session running intent, one unit vector per (layer, head).

``m <- normalize(beta * m + (1 - beta) * normalize(q_bar))`` along ``D`` at each compression
event of the session; first event: ``m = normalize(q_bar)``. ``q_bar`` is normalised before
mixing: post-RoPE query rows have norms ~4-19, so a raw ``q_bar`` would swamp the unit ``m``
(the old memory's share ~7% at ``beta = 0.5``) and the memory would forget at once; with it,
``beta`` is the old memory's share of the direction (``beta = 0.5``: ``m`` bisects the old
memory and the new query). Stored in an LRU keyed by session id; request-local sessions
(``req:`` ids) are never stored, so they can never match.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from agentkv.session import is_request_local


def normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit norm along the last dim."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


class QueryMemoryStore:
    """LRU of session -> memory ``m`` (float32 ``[L, Hq, D]``, CPU)."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._store: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._store)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._store

    def get(self, session_id: str) -> torch.Tensor | None:
        m = self._store.get(session_id)
        if m is not None:
            self._store.move_to_end(session_id)
        return m

    def update(self, session_id: str, q_bar: torch.Tensor, decay: float) -> torch.Tensor:
        """Fold ``q_bar [L, Hq, D]`` into the session's memory and return the new memory
        (float32 ``[L, Hq, D]``, unit norm along ``D``)."""
        q_hat = normalize(q_bar.detach().float().cpu())
        prev = self.get(session_id)
        m = q_hat if prev is None else normalize(decay * prev + (1 - decay) * q_hat)
        if not is_request_local(session_id):
            self._store[session_id] = m
            self._store.move_to_end(session_id)
            while len(self._store) > self.capacity:
                self._store.popitem(last=False)
        return m

    def drop(self, session_id: str) -> None:
        self._store.pop(session_id, None)
