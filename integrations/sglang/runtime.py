"""What the plugin does inside SGLang's processes: tag in the HTTP process, observe and plan in
the scheduler process.

- **HTTP process** (:func:`tag_chat_request`, an AFTER hook on
  ``OpenAIServingChat._convert_to_internal_request``): validates ``custom_params["agentkv"]``
  (a malformed payload is SGLang's HTTP 400, the message naming the field), and for evicting
  policies (no plan reads a FullCache request's tags) renders the request with agentkv's chat
  renderer on SGLang's tokenizer and template, and when those
  tokens are SGLang's prompt tokens adds the per-token tags as
  ``custom_params["agentkv_tags"]``. When they differ (another template path), the request
  runs untagged (plan note says so).
- **Scheduler process** (:func:`run_batch`, an AROUND hook on ``Scheduler.run_batch``): before
  an extend batch, requests whose method observes prefill get an observer (fed by the agentkv
  attention backend, :func:`observe_extend`; KVzap's by the decoder-layer hooks of
  :mod:`.hidden_states`); after it, every request whose prompt is now
  complete is planned with the same ``Method`` registry as the embedded engine, and the plan
  is applied to its ``req_to_token`` row (:func:`~.request_plan.apply_evictions`); after a
  decode batch, methods that prune while decoding plan again (:mod:`.decode_pruning`). The
  forward stream is synchronised first (the keys must be written): one sync per batch that
  completes a planned prefill, also under the overlap scheduler.

**Latch release.** SGLang's ``PrefillAdder`` reserves a new request's whole prompt extension;
when it stops on NO_TOKEN, ``_get_new_batch_prefill_raw`` sets ``running_batch.batch_is_full``
and tries no prefill until the running batch loses a request (``update_running_batch``'s
filter), so the room a plan frees right after the prefill would admit nobody for a whole
turn. After the plans of an extend batch free slots the requests owned, :func:`release_latch`
clears the flag on ``scheduler.running_batch``: the object ``get_next_batch_to_run`` gets next
in both event loops (``event_loop_normal`` / ``event_loop_overlap`` assign it before
``run_batch``, and the next call merges the extend batch into it), so the next
``get_new_batch_prefill`` runs the adder again with the freed room. Where the running batch is
empty, that merge replaces it with the extend batch, whose flag is False: SGLang retries by
itself, nothing is cleared. Default on; ``AGENTKV_SGLANG_RELEASE_LATCH=0`` keeps SGLang's
latch (A/B). Each release logs at debug level (the first also at info) and is counted in
:data:`LATCH`.

Every plan logs one line on the ``agentkv.sglang`` logger (``agentkv plan session=... policy=...
prompt N evicted E live L``); ``AGENTKV_SGLANG_LOG_POSITIONS=1`` adds the evicted positions
(``agentkv positions session=... evicted [...]``), to compare with the embedded engine.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from agentkv.integrations.sglang.decode_pruning import after_decode, watch_decode
from agentkv.integrations.sglang.hidden_states import (
    EXTEND_LAYOUT,
    HIDDEN_DECODING,
    HIDDEN_OBSERVING,
    reset_rows,
)
from agentkv.integrations.sglang.host_time import HOST_TIME, timed
from agentkv.integrations.sglang.query_sums import QuerySumBatch
from agentkv.integrations.sglang.request_plan import (
    HOLEY,
    TAGS_KEY,
    AgentKVRequest,
    apply_evictions,
    check_method,
    check_payload,
    encode_tags,
    evicted_positions,
    plan_request,
    request_state,
)
from agentkv.integrations.sglang.usage import attach_usage, stream_usage_by_default
from agentkv.methods.base import MethodSet, ModelShape, ObserveRequest, PrefillObserver
from agentkv.wire import WIRE_KEY

logger = logging.getLogger("agentkv.sglang")

#: req_pool_idx -> state of requests whose prefill an observer watches (scheduler process).
OBSERVING: dict[int, AgentKVRequest] = {}


#: ``AGENTKV_SGLANG_RELEASE_LATCH=0``: keep SGLang's ``batch_is_full`` after a plan frees slots
RELEASE_LATCH_ENV = "AGENTKV_SGLANG_RELEASE_LATCH"


@dataclass
class LatchReleases:
    """Per scheduler process: how often :func:`release_latch` cleared SGLang's
    ``batch_is_full``, and the slots the plans of those batches freed."""

    count: int = 0
    slots: int = 0


LATCH = LatchReleases()


def release_latch_enabled() -> bool:
    return os.environ.get(RELEASE_LATCH_ENV, "1") != "0"


def release_latch(scheduler: Any, freed: int) -> bool:
    """After an extend batch's plans freed ``freed`` slots: clear SGLang's
    ``scheduler.running_batch.batch_is_full`` so the next ``get_new_batch_prefill`` runs the
    ``PrefillAdder`` again with the room (see the module docstring). Returns whether it was
    cleared: not when nothing was freed, the switch is off, the flag is not set, or the
    running batch is empty (the merge replaces it with the extend batch, flag False)."""
    if freed <= 0 or not release_latch_enabled():
        return False
    running = getattr(scheduler, "running_batch", None)
    if running is None or not running.batch_is_full or running.is_empty():
        return False
    running.batch_is_full = False
    LATCH.count += 1
    LATCH.slots += freed
    if LATCH.count == 1:  # once at info level: the server log shows the release is on
        logger.info(
            "agentkv: batch_is_full released after plans freed %d slots (each release is "
            "logged at debug level; %s=0 turns it off)",
            freed,
            RELEASE_LATCH_ENV,
        )
    logger.debug(
        "agentkv released batch_is_full: plans freed %d slots (releases %d, slots %d)",
        freed,
        LATCH.count,
        LATCH.slots,
    )
    return True


class Planner:
    """Per scheduler process: the method instances (per-session state such as IntentKV's
    QueryMemory lives there) and the model shape."""

    def __init__(self, shape: ModelShape, bytes_per_token: int = 0):
        self.shape = shape
        self.methods = MethodSet(shape)
        #: K+V bytes of one token over all layers at the pool's storage dtype (this rank)
        self.bytes_per_token = bytes_per_token


_PLANNER: Planner | None = None


def init_planner(model_config: Any, kv_pool: Any, tp_size: int = 1) -> Planner:
    """The process's planner (built once): the shape is the KV pool's (this TP rank's heads)."""
    global _PLANNER
    if _PLANNER is None:
        hq = model_config.num_attention_heads // max(1, tp_size)
        shape = ModelShape(kv_pool.layer_num, hq, kv_pool.head_num, kv_pool.head_dim)
        itemsize = getattr(kv_pool, "store_dtype", kv_pool.dtype).itemsize
        _PLANNER = Planner(
            shape, 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * itemsize
        )
    return _PLANNER


def planner_for(scheduler: Any) -> Planner:
    return init_planner(
        scheduler.model_config,
        scheduler.token_to_kv_pool_allocator.get_kvcache(),
        getattr(scheduler, "tp_size", 1),
    )


def planner_methods(ctx: Any) -> MethodSet:
    """For the radix-cache factory (``TreeCacheBuildContext``)."""
    pool = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    return init_planner(ctx.model_config, pool, ctx.tp_size).methods


# ---- HTTP process --------------------------------------------------------------------------


def normalize_tool_call_arguments(message: dict[str, Any]) -> None:
    """SGLang's ``normalize_assistant_tool_call_arguments`` (non-strict) on one message dict,
    in place: an assistant message's tool-call ``arguments`` strings become objects, so the
    chat template renders them as SGLang's prompt has them."""
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
    )

    normalize_assistant_tool_call_arguments(message, strict=False)


def tag_chat_request(result: Any, serving: Any, request: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: ``result`` is ``(GenerateReqInput, ChatCompletionRequest)``."""
    adapted, _ = result
    params = getattr(adapted, "sampling_params", None) or {}
    custom = params.get("custom_params") if isinstance(params, dict) else None
    if not custom:
        return
    custom.pop(TAGS_KEY, None)  # tags are the server's to compute, never a client's
    if custom.get(WIRE_KEY) is None:
        return
    with HOST_TIME.stage("payload"):
        payload = check_payload(custom[WIRE_KEY])  # PayloadError (a ValueError): HTTP 400
    model_config = getattr(getattr(serving, "tokenizer_manager", None), "model_config", None)
    if model_config is not None:  # e.g. KVzap without a surrogate for this model: 400
        tp = getattr(getattr(serving.tokenizer_manager, "server_args", None), "tp_size", 1)
        check_method(payload, model_config, tp if isinstance(tp, int) else 1)
    stream_usage_by_default(request)  # usage.agentkv in a stream's last chunk, as embedded
    if not payload.policy.evicts:
        return  # FullCache: no plan reads tags; skip the second render (~2x SGLang's own)
    ids = getattr(adapted, "input_ids", None)
    if not isinstance(ids, list) or not ids or not isinstance(ids[0], int):
        return
    with HOST_TIME.stage("tag"):  # render, tokenize, tag: what SGLang does once, again
        try:
            from agentkv.engine.chat_template import ChatRenderer

            tokenizer = serving.tokenizer_manager.tokenizer
            renderer = ChatRenderer(tokenizer, template=tokenizer.chat_template)
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            for m in messages:  # as SGLang renders them: tool-call arguments parsed (then the
                # template re-serialises them, `{"k": "v"}`, not the client's `{"k":"v"}`)
                normalize_tool_call_arguments(m)
            tools = None  # as SGLang renders them
            if request.tools and request.tool_choice != "none":
                tools = [t.model_dump() for t in request.tools]
            tags = renderer.encode(messages, tools=tools, annotations=payload.messages)
        except Exception as e:  # the request still runs, untagged
            logger.warning("agentkv: could not tag the request (%s: %s)", type(e).__name__, e)
            return
    if tags.token_ids != ids:
        logger.info("agentkv: tagger tokens differ from SGLang's prompt; request runs untagged")
        return
    custom[TAGS_KEY] = encode_tags(tags)


# ---- scheduler process -----------------------------------------------------------------------


def run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``Scheduler.run_batch``."""
    extend = batch is not None and batch.forward_mode.is_extend()
    if extend:
        before_extend(scheduler, batch)
    try:
        result = original(scheduler, batch, *args, **kwargs)
    finally:
        reset_rows()
        reset_extend_rows()
    if extend:
        after_extend(scheduler, batch)  # timed inside: "sync", "plan"
    elif HIDDEN_DECODING and batch is not None and batch.forward_mode.is_decode():
        after_decode(scheduler, batch, planner_for(scheduler).shape)
    return result


def _prefill_complete(req: Any) -> bool:
    return len(req.get_fill_ids()) >= len(req.origin_input_ids)


def _held_requests(scheduler: Any, batch: Any) -> list[Any]:
    """Every request the scheduler holds: the batch about to run, the running batch, the
    last batch (under the overlap scheduler its results are not processed yet), the chunked
    request between its chunks, the waiting queue."""
    reqs = list(batch.reqs)
    for name in ("running_batch", "last_batch"):
        reqs += list(getattr(getattr(scheduler, name, None), "reqs", None) or [])
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        reqs.append(chunked)
    return reqs + list(getattr(scheduler, "waiting_queue", None) or [])


def drop_orphan_observers(scheduler: Any, batch: Any) -> int:
    """Drop the observer-table entries whose request the scheduler no longer holds; returns
    how many. None should exist (a finish, an abort and a retraction each drop their own in
    ``cache_finished_req``), yet an H100 run fed entries an earlier run's requests had left
    (cause not found): without this a long-running server would keep their buffers (SnapKV's
    and H2O's ``[L, Hq, T]`` sums on the GPU) for good."""
    tables = (OBSERVING, HIDDEN_OBSERVING, HIDDEN_DECODING)
    if not any(tables):
        return 0
    held = {id(getattr(r, "agentkv", None)) for r in _held_requests(scheduler, batch)}
    dropped = 0
    for table in tables:
        for idx, entry in list(table.items()):
            state = getattr(entry, "state", entry)  # HIDDEN_DECODING holds DecodeWatch
            if id(state) not in held:
                del table[idx]
                dropped += 1
    if dropped:
        logger.warning("agentkv: dropped %d observer entries of requests no longer held", dropped)
    return dropped


@timed("before_extend")
def before_extend(scheduler: Any, batch: Any) -> None:
    allocator = scheduler.token_to_kv_pool_allocator
    HOLEY.dead_slot = getattr(allocator, "dead_slot", None)
    drop_orphan_observers(scheduler, batch)
    EXTEND_LAYOUT.record(batch.reqs)
    _EXTEND_ROWS.shape = planner_for(scheduler).shape
    for req in batch.reqs:
        state = request_state(req)
        if state is None:
            continue
        attach_usage(req, state, planner_for(scheduler))  # usage.agentkv (once)
        if state.planned:
            continue
        if HOLEY.dead_slot is not None and state.evicts and _session_prefix(req, state):
            # its plan reads the row anyway (plan_one counts the holes there, no read here);
            # until then it counts as holey: a row without DEAD compacts to itself
            HOLEY.mark(state)
        else:
            _count_dead_in_prefix(req, state)
        if not state.evicts:
            continue
        try:
            _start_observer(planner_for(scheduler), req, state)
        except Exception as e:  # e.g. Method.check refused the policy: run whole, as FullCache
            logger.exception("agentkv: no plan for request %s; nothing evicted", req.rid)
            state.observer = None
            state.planned = True
            state.usage = {"plan_note": f"no plan ({type(e).__name__}); nothing evicted"}
            _count_dead_in_prefix(req, state)


def _session_prefix(req: Any, state: AgentKVRequest) -> bool:
    """Whether the request matched a prefix in its session's namespace (it may hold DEAD)."""
    return len(req.prefix_indices) > 0 and req.prefix_indices is not state.intact_prefix


def _count_dead_in_prefix(req: Any, state: AgentKVRequest) -> None:
    """``state.dead_in_prefix`` (:func:`_dead_in_prefix`), the request marked holey if any."""
    if HOLEY.dead_slot is None:
        return
    state.dead_in_prefix = _dead_in_prefix(req, state, HOLEY.dead_slot)
    if state.dead_in_prefix:
        HOLEY.mark(state)


def _dead_in_prefix(req: Any, state: AgentKVRequest, dead: int) -> int:
    """DEAD positions in the request's matched prefix. A prefix matched in the shared
    namespace (intact runs only) has none: counted without a host read; a session's prefix
    (it may hold holes) is counted on the device and read back."""
    if not _session_prefix(req, state):
        return 0
    return int((req.prefix_indices == dead).sum())


def _takes_hidden(observer: Any) -> bool:
    """Whether the observer implements ``observe_hidden`` (KVzap's score buffer)."""
    return type(observer).observe_hidden is not PrefillObserver.observe_hidden


def _start_observer(p: Planner, req: Any, state: AgentKVRequest) -> None:
    """Give the request its method's observer (as the embedded engine does: every method is
    asked; IntentKV, SnapKV and H2O watch attention, KVzap the layer inputs)."""
    method = p.methods.for_policy(state.payload.policy)
    if state.observer is None:
        state.observer = method.observer(
            state.payload.policy,
            ObserveRequest(
                seq_len=len(state.tags),
                num_cached=len(req.prefix_indices),
                actionable=torch.tensor(state.tags.actionable, dtype=torch.bool),
                shape=p.shape,
            ),
        )
    if state.observer is None:
        return
    if method.observes_prefill:
        OBSERVING[req.req_pool_idx] = state
    if _takes_hidden(state.observer):
        HIDDEN_OBSERVING[req.req_pool_idx] = state


def after_extend(scheduler: Any, batch: Any) -> None:
    todo = []
    for req in batch.reqs:
        state = request_state(req)
        if state is None or state.planned or not _prefill_complete(req):
            continue
        if not state.evicts:
            state.planned = True
            state.usage = {"planned_at": time.perf_counter()}
            continue
        todo.append((req, state))
    if not todo:
        return
    if torch.cuda.is_available():
        with HOST_TIME.stage("sync"):
            torch.cuda.synchronize()
    p = planner_for(scheduler)
    freed = 0
    for req, state in todo:
        try:
            with HOST_TIME.stage("plan"):
                plan_one(
                    p,
                    scheduler.req_to_token_pool,
                    scheduler.token_to_kv_pool_allocator,
                    req,
                    state,
                )
            freed += state.usage["freed_slots"]
        except Exception as e:  # a failed plan leaves the request whole: it runs as FullCache
            logger.exception("agentkv: plan failed for request %s; nothing evicted", req.rid)
            OBSERVING.pop(req.req_pool_idx, None)
            HIDDEN_OBSERVING.pop(req.req_pool_idx, None)
            state.observer = None
            state.planned = True
            state.usage = {"plan_note": f"plan failed ({type(e).__name__}); nothing evicted"}
            _count_dead_in_prefix(req, state)
    release_latch(scheduler, freed)


def plan_one(planner: Planner, req_to_token_pool: Any, allocator: Any, req: Any, state: Any) -> int:
    """Plan one request whose prompt KV is written and apply the plan to its row. Returns the
    positions made DEAD; ``state.usage["freed_slots"]``: those of them whose slot the request
    owned (past its matched prefix), given back to the allocator."""
    t0 = time.perf_counter()
    OBSERVING.pop(req.req_pool_idx, None)
    HIDDEN_OBSERVING.pop(req.req_pool_idx, None)
    T = len(state.tags)
    pool = allocator.get_kvcache()
    r2t = req_to_token_pool.req_to_token
    dead = allocator.dead_slot
    row = r2t[req.req_pool_idx, :T].to(torch.int64)
    live = (row != dead).cpu()  # the row's one read; the live positions found on the host
    live_pos = torch.nonzero(live).reshape(-1).to(row.device)
    live_slots = row[live_pos]

    def read_keys(layer: int):
        # on the pool's device and dtype, as the embedded engine's store hands them out
        return pool.get_key_buffer(layer)[live_slots], live_pos, None

    plan = plan_request(state, planner.methods, planner.shape, live, read_keys)
    observer, state.observer = state.observer, None
    positions = evicted_positions(plan, T)
    n, freed = apply_evictions(
        r2t, req.req_pool_idx, positions, req.cache_protected_len, allocator, live=live
    )
    # new rows are never DEAD: the row's holes are the prefix's (a host count: no read)
    state.dead_in_prefix = T - live_pos.numel()
    if n or state.dead_in_prefix:
        HOLEY.mark(state)
    else:  # before_extend marked a session prefix holey before knowing: it has no hole
        HOLEY.release(state)
    state.planned = True
    state.usage = {
        "evicted_tokens": n,
        "freed_slots": freed,
        "live_kv_tokens": live_pos.numel() - n,
        "plan_note": plan.note if state.tagged else ("untagged; " + plan.note).strip("; "),
        "plan_time_s": time.perf_counter() - t0,
        "planned_at": time.perf_counter(),
    }
    # KVzap: keep scoring while decoding, prune every decode_interval observed steps
    watch_decode(req, state, planner.methods.for_policy(state.payload.policy), observer)
    logger.info(
        "agentkv plan session=%s policy=%s prompt %d evicted %d live %d (%.1f ms)%s",
        state.payload.session_id,
        state.payload.policy.method,
        T,
        n,
        state.usage["live_kv_tokens"],
        1e3 * state.usage["plan_time_s"],
        f" note: {state.usage['plan_note']}" if state.usage["plan_note"] else "",
    )
    if os.environ.get("AGENTKV_SGLANG_LOG_POSITIONS") == "1":  # for comparisons with the engine
        logger.info(
            "agentkv positions session=%s evicted %s",
            state.payload.session_id,
            json.dumps(positions.tolist()),
        )
    return n


class _ExtendRows:
    """Per extend batch, what its observed requests' observers are fed, worked out at the
    first layer and reused by the others (the rows and ``req_to_token`` do not change during
    the forward). Nothing is read back from the device: the layout is the host's
    (:data:`~.hidden_states.EXTEND_LAYOUT`), an observer that sums queries
    (``sums_queries``: IntentKV) joins the batch's :class:`~.query_sums.QuerySumBatch`, and
    one that reads keys (SnapKV, H2O) gets its row's every slot with DEAD masked out
    (``head_mask``) rather than the live ones selected (a selection's length is a read).

    Attributes:
        rows: ``(state, first row, rows, q_pos, slots, k_pos, head_mask)`` per request
            observed one by one (``head_mask`` bool ``[Hkv, m]``: False at DEAD; ``slots`` /
            ``k_pos`` / ``head_mask`` None when its observer reads no keys).
        sums: the batch's query sums, None when no observer sums queries.
    """

    def __init__(self) -> None:
        self.batch: Any = None
        self.rows: list[tuple] = []
        self.sums: QuerySumBatch | None = None
        self.shape: ModelShape | None = None  # the planner's, set by before_extend

    def of(self, backend: Any, forward_batch: Any, q: torch.Tensor) -> list:
        if forward_batch is self.batch:
            return self.rows
        self.batch, self.rows, self.sums = forward_batch, [], None
        pool_idx, starts, lens, prefix = EXTEND_LAYOUT.of(forward_batch)
        dead = HOLEY.dead_slot
        hkv = backend.token_to_kv_pool.get_key_buffer(0).shape[1]
        summed = []
        for i, idx in enumerate(pool_idx):
            state = EXTEND_LAYOUT.entry(OBSERVING, i, idx, len(pool_idx))
            if state is None or state.observer is None:
                continue
            s, n = starts[i], state.prompt_rows(prefix[i], lens[i])
            if n == 0:
                continue
            if state.observer.sums_queries:
                summed.append((state.observer, s, torch.arange(prefix[i], prefix[i] + n)))
                continue
            q_pos = forward_batch.positions[s : s + n].to(torch.int64)
            if not state.observer.reads_keys:
                self.rows.append((state, s, n, q_pos, None, None, None))
                continue
            slots = backend.req_to_token[idx, : prefix[i] + n].to(torch.int64)
            live = slots != dead if dead is not None else torch.ones_like(slots, dtype=torch.bool)
            k_pos = torch.arange(prefix[i] + n, device=slots.device)
            # one mask object for every layer: the observer records the chunk's counts once
            self.rows.append((state, s, n, q_pos, slots, k_pos, live[None].expand(hkv, -1)))
        if summed and self.shape is not None:
            sh = self.shape
            self.sums = QuerySumBatch.build(
                summed, sh.num_layers, sh.num_q_heads, sh.head_dim, q.device
            )
        return self.rows


_EXTEND_ROWS = _ExtendRows()


def reset_extend_rows() -> None:
    """Hand the batch's query sums to their observers, then forget the last extend batch's
    rows (around every batch, with :func:`reset_rows`)."""
    if _EXTEND_ROWS.sums is not None:
        _EXTEND_ROWS.sums.finish()
    _EXTEND_ROWS.batch = None
    _EXTEND_ROWS.rows = []
    _EXTEND_ROWS.sums = None
    EXTEND_LAYOUT.clear()


@timed("observe")
def observe_extend(backend: Any, q: torch.Tensor, layer: Any, forward_batch: Any) -> None:
    """Feed the prefill observers of the batch's observed requests one layer's post-RoPE
    queries (``q [n_tokens, Hq·D]``) and, to those that read keys, their row's keys from the
    KV pool (which the backend wrote first)."""
    if not OBSERVING:
        return
    hq, d = layer.tp_q_head_num, layer.qk_head_dim
    k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    rows = _EXTEND_ROWS.of(backend, forward_batch, q)
    if _EXTEND_ROWS.sums is not None:
        _EXTEND_ROWS.sums.observe(layer.layer_id, q)
    for state, s, n, q_pos, slots, k_pos, head_mask in rows:
        qi = q[s : s + n].reshape(n, hq, d).transpose(0, 1).float()
        if slots is None:
            state.observer.observe(layer.layer_id, qi, q_pos, None, None, None)
            continue
        k = k_buf[slots].transpose(0, 1).float()  # [Hkv, m, D], DEAD masked by head_mask
        state.observer.observe(layer.layer_id, qi, q_pos, k, k_pos, head_mask)
