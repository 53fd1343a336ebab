"""Pruning while decoding, for methods that ask for it (:meth:`Method.decode_interval` > 0).

The engine makes one :class:`DecodePruning` per request after the prefill plan. During decode
its ``observer`` (the method's prefill observer, still collecting: KVzap's score buffer) goes
into every step's :class:`StoreCache` (or a captured step's, whose replays it collects every
``observer.collect_every`` steps), and :meth:`after_step` calls :meth:`Method.plan_decode`
every ``interval`` steps, applies the plan to the store, adds its evictions to the request's
counters and returns what it evicted (:class:`Evicted`), for the engine's views to follow.
:meth:`finish` ends the observer's decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.cache import EvictResult, KVStore, RequestKV
from agentkv.methods import DecodeContext, Method, PlanContext, PrefillObserver


@dataclass
class Evicted:
    """What a decode-time pass evicted.

    Attributes:
        cells: int64 ``[L * Hkv, n]`` the cells the request's map dropped (DEAD padding).
        start, end: they all lie at positions ``start .. end - 1``.
        entries: (layer, KV head, position) cells that went from live to evicted.
    """

    cells: torch.Tensor
    start: int
    end: int
    entries: int


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

    def after_step(self) -> Evicted | None:
        """Call after each decode forward pass: what this step's pass evicted (the views
        follow it: :meth:`LiveView.follow_eviction`, :meth:`KernelDecode.rebuild`), or None
        (no pass due, or nothing to change)."""
        self.steps += 1
        every = self.observer.collect_every
        if every and self.steps % every == 0:
            self.observer.collect()
        if self.steps % self.interval:
            return None
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
            return None
        done: list[tuple[EvictResult, int, int]] = []
        if plan.evict is not None and plan.evict.numel():
            ev = plan.evict.to(torch.int64)
            done.append((self.store.evict(self.req, ev), int(ev.min()), int(ev.max()) + 1))
        if plan.keep_mask is not None:
            a, b = plan.keep_start, plan.keep_start + int(plan.keep_mask.shape[-1])
            done.append((self.store.evict_per_head(self.req, plan.keep_mask, a), a, b))
        if not done:
            return None
        for res, _, _ in done:
            self.counters["evicted_tokens"] += res.positions_dead
            self.counters["evicted_entries"] += res.entries_evicted
        return Evicted(
            torch.cat([res.released for res, _, _ in done], 1),
            min(a for _, a, _ in done),
            max(b for _, _, b in done),
            sum(res.entries_evicted for res, _, _ in done),
        )

    def finish(self) -> None:
        """The request's decode ended (however it ended)."""
        self.observer.end_decode()
