"""Pruning while decoding, for methods that ask for it (:meth:`Method.decode_interval` > 0).

The engine makes one :class:`DecodePruning` per request after the prefill plan. During decode
its ``observer`` (the method's prefill observer, still collecting: KVzap's score buffer) goes
into every step's :class:`StoreCache` (or a captured step's, whose replays it collects every
``observer.collect_every`` steps), and :meth:`after_step` calls :meth:`Method.plan_decode`
every ``interval`` steps, applies the plan to the store, adds its evictions to the request's
counters and returns a fresh :class:`LiveView` (a view is valid only while the slot map
grows). :meth:`finish` ends the observer's decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.cache import KVStore, RequestKV
from agentkv.engine.store_cache import LiveView
from agentkv.methods import DecodeContext, Method, PlanContext, PrefillObserver


@dataclass
class DecodePruning:
    """One request's decode-time pruning state.

    Attributes:
        interval: decode steps between two :meth:`Method.plan_decode` calls.
        counters: the request's plan info (``evicted_tokens``, ``evicted_entries``), updated.
    """

    store: KVStore
    req: RequestKV
    method: Method
    ctx: PlanContext
    observer: PrefillObserver
    interval: int
    counters: dict[str, Any]
    steps: int = field(default=0)
    #: cells the passes since :meth:`take_released` dropped (``[L * Hkv, n]`` each)
    released: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def for_request(
        cls,
        store: KVStore,
        req: RequestKV,
        method: Method,
        ctx: PlanContext,
        observer: PrefillObserver | None,
        counters: dict[str, Any],
    ) -> DecodePruning | None:
        interval = method.decode_interval(ctx.policy)
        if interval <= 0 or observer is None:
            return None
        return cls(store, req, method, ctx, observer, interval, counters)

    def after_step(self, view: LiveView) -> LiveView:
        """Call after each decode forward pass; returns the view to use next."""
        self.steps += 1
        every = self.observer.collect_every
        if every and self.steps % every == 0:
            self.observer.collect()
        if self.steps % self.interval:
            return view
        plan = self.method.plan_decode(
            DecodeContext(
                policy=self.ctx.policy,
                session_id=self.ctx.session_id,
                shape=self.ctx.shape,
                seq_len=self.req.seq_len,
                observation=self.observer.result(),
            )
        )
        if plan is None or plan.is_noop:
            return view
        for res in (
            self.store.evict(self.req, plan.evict) if plan.evict is not None else None,
            self.store.evict_per_head(self.req, plan.keep_mask, plan.keep_start)
            if plan.keep_mask is not None
            else None,
        ):
            if res is not None:
                self.counters["evicted_tokens"] += res.positions_dead
                self.counters["evicted_entries"] += res.entries_evicted
                if res.released is not None:
                    self.released.append(res.released)
        return LiveView(self.store, self.req)

    def take_released(self) -> torch.Tensor | None:
        """The cells (int64 ``[L * Hkv, n]``, DEAD padding) the request's map dropped since
        the last call (a decode index follows them: :meth:`DecodeIndex.drop`), or None."""
        out, self.released = self.released, []
        return torch.cat(out, dim=1) if out else None

    def finish(self) -> None:
        """The request's decode ended (however it ended)."""
        self.observer.end_decode()
