"""Pruning while decoding on SGLang, for methods that ask for it (:meth:`Method.decode_interval`
> 0: KVzap), where SGLang runs the decode step eagerly.

After the prefill plan, :func:`watch_decode` keeps the request's observer (KVzap's score
buffer) in :data:`~.hidden_states.HIDDEN_DECODING`; the decoder-layer hooks then hand it each
decode step's layer inputs (one row per request) and record the position fed. After each
decode batch, :func:`after_decode` counts the request's *observed* steps and every
``interval`` of them calls :meth:`Method.plan_decode` and applies the plan to the request's
``req_to_token`` row as the prefill plan is applied (DEAD redirect, slots the request owns
freed; one device synchronisation per plan).

SGLang replays decode steps from CUDA graphs, where Python hooks do not run: those steps are
not observed, their positions stay unscored (KVzap keeps them) and they do not count towards
the interval. Pruning while decoding therefore needs the decode graphs off
(``--disable-decode-cuda-graph``, or ``--disable-cuda-graph``); batches larger than the
largest captured graph run eagerly and are observed anyway. The request's ``plan_note`` says
how many decode steps were observed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.integrations.sglang.hidden_states import HIDDEN_DECODING
from agentkv.integrations.sglang.host_time import timed
from agentkv.integrations.sglang.request_plan import (
    HOLEY,
    AgentKVRequest,
    apply_evictions,
    evicted_positions,
    request_state,
)
from agentkv.methods.base import DecodeContext, Method, ModelShape

logger = logging.getLogger("agentkv.sglang")


@dataclass
class DecodeWatch:
    """One request's decode-time pruning state (scheduler process).

    Attributes:
        state: the request's agentkv state.
        observer: the method's observer, still collecting (KVzap's score buffer).
        method: the method instance that planned the prompt.
        interval: observed decode steps between two :meth:`Method.plan_decode` calls.
        fed: int64 ``[1]`` positions the hooks fed since the last :func:`after_decode`.
        observed: decode steps whose layer inputs the hooks saw.
        plans: ``plan_decode`` calls made.
    """

    state: AgentKVRequest
    observer: Any
    method: Method
    interval: int
    fed: list[torch.Tensor] = field(default_factory=list)
    observed: int = 0
    plans: int = 0


def watch_decode(req: Any, state: AgentKVRequest, method: Method, observer: Any) -> bool:
    """After the prefill plan: keep watching the request while it decodes if its method prunes
    while decoding. Returns whether it does."""
    interval = method.decode_interval(state.payload.policy)
    if interval <= 0 or observer is None:
        return False
    HIDDEN_DECODING[req.req_pool_idx] = DecodeWatch(state, observer, method, interval)
    state.usage |= {"decode_interval": interval, "decode_observed": 0, "decode_evictions": []}
    return True


@timed("decode_plans")
def after_decode(scheduler: Any, batch: Any, shape: ModelShape) -> int:
    """After a decode batch: count observed steps, plan the requests whose interval is due and
    apply the plans. Returns the positions made DEAD."""
    due: list[tuple[Any, DecodeWatch, int]] = []
    for req in batch.reqs:
        watch = HIDDEN_DECODING.get(req.req_pool_idx)
        if watch is None or watch.state is not request_state(req):
            continue
        fed, watch.fed = watch.fed, []
        if not fed:  # replayed from a CUDA graph: the hooks did not run
            continue
        watch.observed += 1
        watch.state.usage["decode_observed"] = watch.observed
        if watch.observed % watch.interval == 0:
            due.append((req, watch, int(fed[-1][-1]) + 1))
    if not due:
        return 0
    if torch.cuda.is_available():  # the step's KV and req_to_token reads are done
        torch.cuda.synchronize()
    total = 0
    for req, watch, seq_len in due:
        try:
            total += _plan_step(scheduler, req, watch, seq_len, shape)
        except Exception:  # a failed decode plan keeps everything, as a skipped one
            logger.exception("agentkv: decode plan failed for request %s", req.rid)
            HIDDEN_DECODING.pop(req.req_pool_idx, None)
    return total


def _plan_step(scheduler: Any, req: Any, watch: DecodeWatch, seq_len: int, shape: Any) -> int:
    state = watch.state
    plan = watch.method.plan_decode(
        DecodeContext(
            policy=state.payload.policy,
            session_id=state.payload.session_id,
            shape=shape,
            seq_len=seq_len,
            observation=watch.observer.result(),
        )
    )
    watch.plans += 1
    if plan is None or plan.is_noop:
        return 0
    allocator = scheduler.token_to_kv_pool_allocator
    positions = evicted_positions(plan, seq_len)
    n, _ = apply_evictions(
        scheduler.req_to_token_pool.req_to_token,
        req.req_pool_idx,
        positions,
        req.cache_protected_len,
        allocator,
    )
    if n:
        HOLEY.mark(state)
        state.usage["evicted_tokens"] = int(state.usage.get("evicted_tokens", 0)) + n
        # (decode steps forwarded so far, positions gone): for live and reads in usage.agentkv
        state.usage["decode_evictions"].append((seq_len - len(state.tags), n))
    logger.info(
        "agentkv decode plan session=%s policy=%s positions %d evicted %d",
        state.payload.session_id,
        state.payload.policy.method,
        seq_len,
        n,
    )
    return n


def decode_usage(plan: dict[str, Any], planned_live: int, forwarded: int) -> tuple[int, int, str]:
    """From the request's plan info (``plan`` = ``state.usage``), after ``forwarded`` decode
    steps: positions the decode plans made DEAD, the reads they saved (each later step reads
    that many fewer), and the plan-note suffix."""
    if "decode_interval" not in plan:
        return 0, 0, ""
    events = plan.get("decode_evictions", [])
    gone = sum(n for _, n in events)
    saved = sum(n * max(forwarded - f, 0) for f, n in events)
    note = (
        f"decode pruning every {plan['decode_interval']} steps: "
        f"{plan.get('decode_observed', 0)}/{forwarded} steps observed (not those replayed "
        f"from CUDA graphs), {gone} evicted"
    )
    return gone, saved, note
