"""``usage.agentkv`` in SGLang's OpenAI chat responses (streamed too): the embedded engine's
:class:`~agentkv.engine.telemetry.KVUsage` fields, built where the plan ran and carried back
the way SGLang carries per-request data.

The plan runs in the scheduler process; the response is built in the HTTP (tokenizer manager)
process. SGLang 0.5.17 carries per-request data between them in ``Req.customized_info``: a
dict of per-output-token columns that its output streamer slices at every send
(``values[sent : len(output_ids)]``), the detokenizer passes along, and the tokenizer manager
accumulates into ``meta_info[key]`` (sliced again for incremental streaming). So:

- **scheduler** (:class:`UsageColumn`, put in ``req.customized_info["agentkv"]`` when the
  request is first scheduled): a column whose slices are ``None`` per output token, except
  the last entry of the send that finishes the request, which is the request's telemetry
  (a plain dict, :func:`kv_usage`);
- **HTTP process** (hooks on ``OpenAIServingChat``): :func:`add_usage_to_response` (AFTER
  ``_build_chat_response``) puts it in ``usage.agentkv`` of a non-streamed response;
  :func:`watch_stream_content` (AROUND ``_generate_stream_content``, which sees every
  ``meta_info``) and :func:`add_usage_to_stream` (AROUND ``_generate_chat_stream``) put it in
  the final usage chunk of a stream. SGLang (like OpenAI) sends that chunk only when the
  request sets ``stream_options.include_usage``; the embedded server sends it unless told
  not to, and so does the plugin for requests with an agentkv payload
  (:func:`stream_usage_by_default`, called by the HTTP tagging hook): a request's explicit
  ``include_usage: false`` is kept.

Requests without an agentkv payload carry no column: their responses are stock SGLang's
(when one is batched with agentkv requests, SGLang pads its ``meta_info["agentkv"]`` with
``None``; only ``/generate`` shows ``meta_info``).

What the fields mean on SGLang (same names and units as the embedded engine; see
docs/sglang.md): SGLang's KV slot holds every layer and KV head of a position, so live,
resident and effective counts coincide (a per-head plan frees only positions no head keeps,
and every head reads the rest): ``live_kv_tokens == resident_kv_tokens``, bytes at the pool's
dtype, ``quantized_entries == 0`` (no quantized pools). Decode KV is the generated tokens but
the last (never forwarded). ``raw_kv_reads`` / ``effective_kv_reads`` count decode steps as
the embedded engine does, from those counts (SGLang's kernels read exactly the live slots).
``slot_map_bytes`` is the request's entries of SGLang's ``req_to_token`` row (int32 per
position, on the device). Times run from the request's entry into the scheduler's wait queue.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from agentkv.engine.telemetry import KVUsage
from agentkv.integrations.sglang.decode_pruning import decode_usage

logger = logging.getLogger("agentkv.sglang")

#: ``Req.customized_info`` / ``meta_info`` key.
USAGE_KEY = "agentkv"


# ---- scheduler process -------------------------------------------------------------------------


class UsageColumn:
    """``req.customized_info[USAGE_KEY]``: one entry per output token, as SGLang's output
    streamer slices it. ``None`` everywhere but the last entry of the send that finishes the
    request, which is :func:`kv_usage`'s dict (a send that finishes with no new token gets a
    one-entry list). Nothing is built before the request finishes."""

    __slots__ = ("req", "state", "planner")

    def __init__(self, req: Any, state: Any, planner: Any):
        self.req, self.state, self.planner = req, state, planner

    def __getitem__(self, key: slice) -> list[Any]:
        if not isinstance(key, slice):
            raise TypeError("UsageColumn is sliced per send, never indexed")
        start = key.start or 0
        stop = len(self.req.output_ids) if key.stop is None else key.stop
        n = max(0, stop - start)
        out: list[Any] = [None] * n
        if not self.req.finished():
            return out
        try:
            usage = kv_usage(self.req, self.state, self.planner, completion=stop)
        except Exception:  # telemetry never takes the scheduler down
            logger.exception("agentkv: no usage for request %s", getattr(self.req, "rid", "?"))
            return out
        if n:
            out[-1] = usage
        else:
            out.append(usage)
        return out


def attach_usage(req: Any, state: Any, planner: Any) -> None:
    """Give ``req`` its usage column (once; other keys of ``customized_info`` are kept)."""
    info = req.customized_info
    if info is None:
        req.customized_info = info = {}
    if USAGE_KEY not in info:
        info[USAGE_KEY] = UsageColumn(req, state, planner)
        state.seen_at = _queue_entry(req)


def _queue_entry(req: Any) -> float:
    """perf_counter time the request entered the scheduler's wait queue (now if unknown)."""
    now = time.perf_counter()
    t = getattr(getattr(req, "time_stats", None), "wait_queue_entry_time", 0.0) or 0.0
    return t if 0.0 < t <= now else now


def kv_usage(req: Any, state: Any, planner: Any, completion: int) -> dict[str, Any]:
    """The request's :class:`KVUsage` as a dict (plus ``dropped_image_parts``, as the embedded
    server adds), ``completion`` output tokens (SGLang's count: the stop token included)."""
    payload, tags, shape = state.payload, state.tags, planner.shape
    T = len(req.origin_input_ids)
    plan = state.usage
    forwarded = max(completion - 1, 0)  # decode steps whose KV was written
    planned_live = int(plan.get("live_kv_tokens", T - state.dead_in_prefix))
    decode_gone, reads_saved, decode_note = decode_usage(plan, planned_live, forwarded)
    live = planned_live + forwarded - decode_gone
    positions = T + forwarded
    f = forwarded
    now = time.perf_counter()
    t0 = state.seen_at or now
    planned_at = plan.get("planned_at", now)
    if "forced_tokens" not in plan:  # cheap: once per request, at its end
        method = planner.methods.for_policy(payload.policy)
        plan["forced_tokens"] = sum(tags.forced(method.protects_system(payload.policy)))
    nbytes = live * planner.bytes_per_token
    hit = int(getattr(req, "cached_tokens", 0) or 0)
    usage = KVUsage(
        method=payload.policy.method,
        policy=payload.policy.describe(),
        session_id=payload.session_id,
        node=payload.node,
        prompt_tokens=T,
        completion_tokens=completion,
        prefix_hit_tokens=hit,
        prefix_hit_rate=hit / T if T else 0.0,
        peak_request_tokens=T + completion,
        live_kv_tokens=float(live),
        live_kv_bytes=nbytes,
        resident_kv_tokens=live,
        resident_kv_bytes=nbytes,
        resident_kv_bytes_by_precision={"full": nbytes, "int4": 0, "int2": 0},
        quantized_entries=0,
        slot_map_bytes=4 * positions,
        planned_live_kv_tokens=float(planned_live),
        compression_ratio=round(1 - live / max(positions, 1), 4),
        forced_tokens=int(plan["forced_tokens"]),
        evicted_tokens=int(plan.get("evicted_tokens", 0)),
        evicted_entries=int(plan.get("evicted_tokens", 0)) * shape.num_layers * shape.num_kv_heads,
        raw_kv_reads=f * T + f * (f + 1) // 2,
        effective_kv_reads=f * planned_live + f * (f + 1) // 2 - reads_saved,
        wall_time_s=round(now - t0, 4),
        prefill_time_s=round(max(planned_at - t0, 0.0), 4),
        decode_time_s=round(max(now - planned_at, 0.0), 4),
        plan_note="; ".join(
            x
            for x in (
                plan.get("plan_note", "") or ("" if state.tagged else "untagged"),
                decode_note,
            )
            if x
        ),
    ).model_dump()
    usage["dropped_image_parts"] = 0  # the plugin drops nothing: SGLang handles image parts
    return usage


# ---- HTTP process ------------------------------------------------------------------------------


def stream_usage_by_default(request: Any) -> None:
    """A streamed chat request with an agentkv payload and no ``stream_options`` gets
    ``include_usage=True`` (the embedded server's default), so its last chunk carries
    ``usage.agentkv``."""
    if getattr(request, "stream", False) and getattr(request, "stream_options", None) is None:
        from sglang.srt.entrypoints.openai.protocol import StreamOptions

        request.stream_options = StreamOptions(include_usage=True)


def usage_from_meta(meta_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The telemetry dict in a response's ``meta_info`` (the column's last entry), or None."""
    column = (meta_info or {}).get(USAGE_KEY)
    if not isinstance(column, Sequence):
        return None
    for item in reversed(column):
        if isinstance(item, dict):
            return item
    return None


_RESPONSE_TYPES: dict[str, type] = {}


def _response_types() -> tuple[type, type]:
    """Subclasses of SGLang's ``UsageInfo`` and ``ChatCompletionResponse`` with an
    ``agentkv`` field (pydantic serialises a field by its declared type, so the response
    class must declare the usage subclass)."""
    if not _RESPONSE_TYPES:
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponse, UsageInfo

        class AgentKVUsageInfo(UsageInfo):
            agentkv: dict[str, Any] | None = None

        class AgentKVChatCompletionResponse(ChatCompletionResponse):
            usage: AgentKVUsageInfo

        _RESPONSE_TYPES["usage"] = AgentKVUsageInfo
        _RESPONSE_TYPES["response"] = AgentKVChatCompletionResponse
    return _RESPONSE_TYPES["usage"], _RESPONSE_TYPES["response"]


def add_usage_to_response(
    result: Any, serving: Any, request: Any, ret: list[dict[str, Any]], *args: Any, **kwargs: Any
) -> Any:
    """AFTER hook on ``OpenAIServingChat._build_chat_response``: the same response, as a
    ``ChatCompletionResponse`` subclass whose ``usage`` has ``agentkv`` (the first choice's;
    None: the response is left as SGLang built it)."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponse

    if not isinstance(result, ChatCompletionResponse) or not ret:
        return None
    found = usage_from_meta(ret[0].get("meta_info"))
    if found is None:
        return None
    usage_cls, response_cls = _response_types()
    fields = {name: getattr(result, name) for name in type(result).model_fields}
    fields["usage"] = usage_cls(**dict(result.usage), agentkv=found)
    return response_cls(**fields)


#: id(ChatCompletionRequest) -> {choice index: telemetry} for the streams in flight.
_STREAMS: dict[int, dict[int, dict[str, Any]]] = {}


async def watch_stream_content(original: Any, serving: Any, *args: Any, **kwargs: Any):
    """AROUND hook on ``OpenAIServingChat._generate_stream_content`` (called with keywords for
    every output of a stream): keep the telemetry its ``meta_info`` carries."""
    seen = _STREAMS.get(id(kwargs.get("request")))
    meta = (kwargs.get("content") or {}).get("meta_info") or {}
    # only the output that finishes a request carries it (and the column grows per token:
    # scanning it on every chunk would cost O(tokens^2) per stream)
    if seen is not None and meta.get("finish_reason") is not None:
        found = usage_from_meta(meta)
        if found is not None:
            seen[kwargs.get("index", 0)] = found
    async for chunk in original(serving, *args, **kwargs):
        yield chunk


async def add_usage_to_stream(
    original: Any, serving: Any, adapted_request: Any, request: Any, *args: Any, **kwargs: Any
) -> AsyncIterator[str]:
    """AROUND hook on ``OpenAIServingChat._generate_chat_stream``: the stream, with
    ``usage.agentkv`` (choice 0's) added to its final usage chunk."""
    key = id(request)
    seen: dict[int, dict[str, Any]] = {}
    _STREAMS[key] = seen
    try:
        async for chunk in original(serving, adapted_request, request, *args, **kwargs):
            if seen and _is_usage_chunk(chunk):
                chunk = _with_usage(chunk, seen.get(0) or next(iter(seen.values())))
            yield chunk
    finally:
        _STREAMS.pop(key, None)


def _is_usage_chunk(chunk: Any) -> bool:
    """SGLang's final usage chunk: ``data: {...,"choices":[],...,"usage":{...}}``."""
    return (
        isinstance(chunk, str)
        and chunk.startswith("data: {")
        and '"choices":[]' in chunk
        and '"usage":{' in chunk
    )


def _with_usage(chunk: str, found: dict[str, Any]) -> str:
    try:
        body = json.loads(chunk[len("data: ") :])
    except ValueError:
        return chunk
    if not isinstance(body.get("usage"), dict):
        return chunk
    body["usage"]["agentkv"] = found
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
