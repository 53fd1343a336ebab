"""OpenAI-compatible HTTP server for the embedded engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions`` (non-streaming and SSE streaming, ``tools``,
tool-call parsing), ``GET /v1/models``, ``GET /health``, and agentkv's own
``GET/DELETE /v1/agentkv/sessions/{session_id}`` (session telemetry with a per-node
breakdown / end a session), ``GET /v1/agentkv/capabilities`` (protocol version and the
policy methods this engine implements; clients warn about the others) and
``POST /v1/agentkv/flush`` (admin: drop the prefix cache).

Every request is logged (logger ``agentkv.server``, INFO): session, node, policy, prompt
tokens and prefix hits, live and evicted KV, wall time.

The agentkv payload is read from ``custom_params["agentkv"]`` (absent -> FullCache; a
payload without message annotations gets them derived from the request's messages).
Responses carry ``usage.agentkv`` (:class:`agentkv.engine.telemetry.KVUsage`). Bad input ->
HTTP 400 with an OpenAI-style error naming the field; the server keeps serving. Image content
parts, which the text-only model cannot read, are dropped from the prompt and counted in
``usage.agentkv.dropped_image_parts`` (or rejected: ``ServerOptions.image_parts``).

Multi-tenant safety (docs/security.md): ``--api-key`` keys, one tenant each; a tenant plus the
request's ``cache_salt`` is a namespace that scopes the prefix cache, session ids and session
telemetry (:mod:`agentkv.engine.tenancy`). Faults: bodies over ``--max-request-bytes`` are a 413
before parsing; a request that can never fit the model's context or the KV pool is a 400
before prefill; a client that disconnects cancels its generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentkv.cache import OutOfSlots
from agentkv.engine.capabilities import add_capabilities_route
from agentkv.engine.engine import (
    ChatResult,
    Engine,
    GenerationConfig,
    PreparedChat,
    RequestCancelled,
    RequestError,
)
from agentkv.engine.telemetry import KVUsage
from agentkv.engine.tenancy import ServerOptions, Tenancy
from agentkv.session import scope_session_id, unscope_session_id
from agentkv.wire import CUSTOM_PARAMS, WIRE_KEY, PayloadError, payload_from_request

log = logging.getLogger("agentkv.server")


PAYLOAD_PARAM = f"{CUSTOM_PARAMS}.{WIRE_KEY}"


#: image content-part types: dropped from the text-only model's prompt and counted in
#: ``usage.agentkv.dropped_image_parts`` (``--image-parts drop``), or a 400 (``reject``)
IMAGE_PARTS = frozenset({"image_url", "image", "input_image"})
#: other content-part types a text-only model cannot read: rejected (400), never dropped
MEDIA_PARTS = frozenset({"input_audio", "audio", "file", "input_file", "video_url"})
MAX_STOP = 16


class ContentPart(BaseModel):
    """One content block (``{"type": "text", "text": ...}``; reasoning and tool-call blocks as
    LangChain sends them pass). Audio, video and file parts are a 400: the embedded engine
    serves a text-only model and will not pretend to have heard or read them. Image parts
    pass validation; :func:`drop_image_parts` then drops them (counted) or rejects them."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str = "text"
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type in MEDIA_PARTS:
            raise ValueError(
                f"{self.type!r} content parts are not supported: this server's model reads "
                "text only"
            )
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a 'text' string")
        return self


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = Field("{}", description="JSON string (or object)")


class ToolCall(BaseModel):
    """One entry of an assistant message's ``tool_calls`` (OpenAI format)."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One request message (OpenAI format); validated for shape, passed on as sent."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[str | ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"] = "function"
    function: ToolFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = Field(True, description="send a final usage chunk (default: yes)")


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request the engine honours (others ignored).

    Strict types: ``"5"`` is not a number, ``1`` is not a boolean.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = Field(
        None, description=f"a stop string or a list of at most {MAX_STOP}"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = Field(
        None,
        description="'auto' or 'none' ('none' hides the tools from the model); 'required' "
        "and a named tool are not supported (the engine does not constrain decoding)",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="vLLM's cache salt: prefix-cache reuse and sessions only among requests "
        "with the same salt (and tenant)",
    )
    custom_params: dict[str, Any] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v == "required" or isinstance(v, dict):
            raise ValueError(
                f"tool_choice {v!r} is not supported: the engine does not constrain decoding "
                "to a tool call; use 'auto' (or 'none')"
            )
        return v


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers


def _error(
    status: int,
    message: str,
    param: str | None,
    kind: str,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
        headers=dict(headers) if headers else None,
    )


def drop_image_parts(messages: list[Any], mode: Literal["drop", "reject"]) -> tuple[list[Any], int]:
    """``messages`` without their image content parts, and how many were dropped.

    The embedded engine's model reads text only: an image part is dropped from the prompt
    (``mode="drop"``, counted in ``usage.agentkv.dropped_image_parts`` and logged) or the
    request is a 400 naming the first one (``mode="reject"``). Never silently ignored."""
    out, dropped = [], 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        kept = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                if mode == "reject":
                    raise APIError(
                        400,
                        f"{part['type']!r} content parts are not supported: this server's "
                        "model reads text only (agentkv serve --image-parts drop drops them)",
                        f"messages.{i}.content.{j}",
                    )
                dropped += 1
            else:
                kept.append(part)
        out.append({**message, "content": kept} if len(kept) < len(content) else message)
    return out, dropped


def _message(result: ChatResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        msg["tool_calls"] = result.tool_calls
    return msg


def _usage(
    result: ChatResult, namespace: str | None = None, dropped_image_parts: int = 0
) -> dict[str, Any]:
    u = result.usage
    ak = u.model_dump()
    ak["session_id"] = unscope_session_id(namespace, u.session_id)  # the id the client knows
    ak["dropped_image_parts"] = dropped_image_parts  # image parts the text-only model never saw
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "agentkv": ak,
    }


FLUSH_PATH = "/v1/agentkv/flush"
UNAUTHENTICATED_PATHS = frozenset({"/health", FLUSH_PATH})


def _caller(raw: Request) -> str:
    """The tenant that :func:`create_app`'s auth dependency resolved for this request."""
    return raw.state.tenant


def create_app(engine: Engine, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (``options``: auth and limits; default: none, 1 MiB)."""
    options = options or ServerOptions()
    tenancy = Tenancy(options)

    async def authenticate(raw: Request) -> None:
        """Every route but ``/health`` needs a valid key when keys are configured (admin
        routes check the admin key themselves)."""
        if raw.url.path in UNAUTHENTICATED_PATHS:
            return
        tenant = tenancy.tenant(raw.headers.get("authorization"))
        if tenant is None:
            raise APIError(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                None,
                "authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        raw.state.tenant = tenant

    app = FastAPI(
        title="agentkv embedded engine", version="1", dependencies=[Depends(authenticate)]
    )
    app.state.engine = engine
    app.state.tenancy = tenancy

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), None, kind, exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", None, "server_error")

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "body"]
        return _error(
            400,
            f"{'.'.join(loc) or 'body'}: {err['msg']}",
            ".".join(loc) or None,
            "invalid_request_error",
        )

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "agentkv"}
            ],
        }

    add_capabilities_route(app, engine)

    # ------------------------------------------------ sessions (scoped to the caller)
    def _session_key(raw: Request, cache_salt: str | None) -> str:
        return tenancy.namespace(_caller(raw), cache_salt)

    @app.get("/v1/agentkv/sessions/{session_id:path}")
    def session(raw: Request, session_id: str, cache_salt: str | None = None) -> dict[str, Any]:
        """Telemetry of one of the caller's sessions (``cache_salt``: the salt it used)."""
        namespace = _session_key(raw, cache_salt)
        summary = engine.sessions.get(scope_session_id(namespace, session_id))
        if summary is None:
            raise APIError(404, f"unknown session {session_id!r}", "session_id", "not_found_error")
        out = {**summary.model_dump(), "prefix_hit_rate": summary.prefix_hit_rate}
        return {**out, "session_id": session_id}

    @app.delete("/v1/agentkv/sessions/{session_id:path}")
    def end_session(raw: Request, session_id: str, cache_salt: str | None = None) -> dict[str, Any]:
        """End one of the caller's sessions: its cached KV, method state and telemetry."""
        namespace = _session_key(raw, cache_salt)
        known = engine.sessions.get(scope_session_id(namespace, session_id)) is not None
        freed = engine.end_session(session_id, namespace)
        if not known and freed == 0:
            raise APIError(404, f"unknown session {session_id!r}", "session_id", "not_found_error")
        return {"session_id": session_id, "slots_freed": freed}

    # --------------------------------------------------------------------- admin
    @app.post(FLUSH_PATH)
    def flush(raw: Request) -> dict[str, Any]:
        """Drop the whole prefix cache, every tenant's (admin key; open without any keys)."""
        if not tenancy.is_admin(raw.headers.get("authorization")):
            raise APIError(
                403,
                "flushing the prefix cache needs the admin API key (--admin-api-key)",
                None,
                "permission_error",
            )
        freed = engine.flush_prefix_cache()
        free = engine.store.allocator.free_count
        return {"slots_freed": freed, "free_slots": free, "capacity": engine.kv_capacity}

    # ------------------------------------------------------------ chat completions
    @app.post(
        "/v1/chat/completions",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _REQUEST_SCHEMA}},
            }
        },
    )
    async def chat_completions(raw: Request) -> Any:
        try:
            return await _chat_completions(engine, tenancy, raw)
        except (APIError, StarletteHTTPException):
            raise
        except Exception as e:  # a 500 that keeps the connection (no re-raise to the server)
            log.exception("request failed")
            msg = f"internal error: {type(e).__name__}: {e}"
            raise APIError(500, msg, None, "server_error") from None

    _declare_schemas(app)
    return app


async def _chat_completions(engine: Engine, tenancy: Tenancy, raw: Request) -> Any:
    body = await _read_json(raw, tenancy.options.max_request_bytes)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        field, err = _first_error(e, body)
        raise APIError(400, f"{field}: {err['msg']}", field) from None
    try:
        payload = payload_from_request(body)
    except PayloadError as e:
        param = e.field if e.field == CUSTOM_PARAMS else _payload_param(e.field)
        raise APIError(400, str(e), param) from None
    namespace = tenancy.namespace(_caller(raw), req.cache_salt)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    cancel = threading.Event()  # set when the client goes away
    gen = GenerationConfig(
        max_tokens=req.max_completion_tokens or req.max_tokens,  # None: engine default
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=stop,
        should_stop=cancel.is_set,
    )
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    tools = None if req.tool_choice == "none" else body.get("tools") or None
    messages, dropped = drop_image_parts(body["messages"], tenancy.options.image_parts)
    if dropped:
        log.info("dropped %d image content parts: the model reads text only", dropped)
    body = {**body, "messages": messages}
    # validate, render and tag before answering, so bad input is a 400 even when streaming
    prepared = await asyncio.to_thread(_prepare, engine, body, tools, payload, gen, namespace)
    if req.stream:
        include_usage = req.stream_options is None or req.stream_options.include_usage
        return StreamingResponse(
            _stream(engine, req, prepared, rid, include_usage, raw, cancel, dropped),
            media_type="text/event-stream",
        )
    result = await _run_watching(engine, prepared, raw, cancel)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or engine.model_name,
        "choices": [
            {
                "index": 0,
                "message": _message(result),
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(result, prepared.namespace, dropped),
    }


async def _read_json(raw: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; over ``limit`` bytes: 413 before it is parsed."""
    too_big = APIError(
        413,
        f"request body exceeds the server's limit of {limit} bytes (--max-request-bytes)",
        None,
    )
    length = raw.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in raw.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def _first_error(e: ValidationError, body: Any) -> tuple[str, Any]:
    """The most specific validation error (deepest in the body: inside a union, the member
    that got furthest; at equal depth a failed check beats a wrong type) and its dotted
    field path."""
    best: tuple[tuple[int, bool], str, Any] | None = None
    for err in e.errors():
        field, depth = _loc_path(err["loc"], body, err["type"] == "missing")
        rank = (depth, not err["type"].endswith("_type"))
        if best is None or rank > best[0]:
            best = (rank, field, err)
    assert best is not None
    return best[1], best[2]


async def _run_watching(
    engine: Engine, prepared: PreparedChat, raw: Request, cancel: threading.Event
) -> ChatResult:
    """Run the request in a worker thread; cancel it if the client disconnects meanwhile."""
    task = asyncio.ensure_future(asyncio.to_thread(_run, engine, prepared))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await raw.is_disconnected():
                cancel.set()
        return task.result()
    finally:
        if not task.done():  # the handler itself was cancelled (server shutting down)
            cancel.set()


DISCONNECT_POLL_S = 0.1


def log_request(usage: KVUsage) -> None:
    """One INFO line per served request (logger ``agentkv.server``)."""
    log.info(
        "session=%s node=%s policy=%s prompt=%d prefix_hits=%d completion=%d "
        "live_kv=%.0f evicted=%d wall=%.2fs",
        usage.session_id,
        usage.node or "-",
        usage.policy,
        usage.prompt_tokens,
        usage.prefix_hit_tokens,
        usage.completion_tokens,
        usage.live_kv_tokens,
        usage.evicted_tokens,
        usage.wall_time_s,
    )


def _loc_path(loc: tuple[Any, ...], data: Any, missing: bool) -> tuple[str, int]:
    """Dotted path of a validation error in the request body, without pydantic's union-member
    tags (``messages.0.content.1``, not ``messages.0.content.list[...].1.ContentPart``), and
    how many of its segments index into the body."""
    out: list[str] = []
    cur = data
    for i, seg in enumerate(loc):
        key = isinstance(cur, dict) and isinstance(seg, str) and seg in cur
        index = isinstance(cur, list) and isinstance(seg, int) and 0 <= seg < len(cur)
        if key or index:
            cur = cur[seg]
        elif missing and i == len(loc) - 1 and isinstance(cur, dict):
            pass  # a missing required field is kept
        else:
            continue  # a union-member tag, not a field
        out.append(str(seg))
    return ".".join(out) or "body", len(out)


def _loc_param(loc: tuple[Any, ...], data: Any, missing: bool) -> str:
    return _loc_path(loc, data, missing)[0]


def _payload_param(field: str | None) -> str:
    return f"{PAYLOAD_PARAM}.{field}" if field else PAYLOAD_PARAM


def _request_error(e: RequestError) -> APIError:
    field = e.field
    if field is not None and (field == "payload" or field.startswith("payload.")):
        field = _payload_param(field.partition(".")[2] or None)
    return APIError(400, str(e), field)


def _prepare(
    engine: Engine, body: dict[str, Any], tools, payload, gen, namespace: str
) -> PreparedChat:
    try:
        return engine.prepare_chat(body["messages"], tools, payload, gen, namespace=namespace)
    except RequestError as e:
        raise _request_error(e) from None


def _run(engine: Engine, prepared: PreparedChat, on_text=None) -> ChatResult:
    try:
        result = engine.run_chat(prepared, on_text=on_text)
        log_request(result.usage)
        return result
    except RequestError as e:
        raise _request_error(e) from None
    except RequestCancelled:
        raise APIError(499, "client closed the request", None, "cancelled") from None
    except OutOfSlots as e:  # fits the pool, not now: other requests hold the rest
        raise APIError(
            503, f"KV pool busy: {e}", None, "server_error", headers={"Retry-After": "1"}
        ) from None


async def _stream(
    engine,
    req,
    prepared: PreparedChat,
    rid: str,
    include_usage: bool,
    raw: Request,
    cancel: threading.Event,
    dropped_image_parts: int = 0,
) -> AsyncIterator[str]:
    """SSE chunks in OpenAI's ``chat.completion.chunk`` format, then ``[DONE]``. A client
    that goes away (checked between chunks, and by Starlette) cancels the generation."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    created = int(time.time())
    model = req.model or engine.model_name

    def chunk(delta: dict[str, Any], finish: str | None = None, usage=None) -> str:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            if usage is None
            else [],
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def work() -> None:
        try:
            result = _run(
                engine,
                prepared,
                on_text=lambda t: loop.call_soon_threadsafe(queue.put_nowait, ("text", t)),
            )
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
        except APIError as e:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
        except Exception as e:  # keep serving; report in-band
            log.exception("stream failed")
            loop.call_soon_threadsafe(
                queue.put_nowait, ("error", APIError(500, str(e), None, "server_error"))
            )

    threading.Thread(target=work, daemon=True).start()
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            try:
                kind, item = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await raw.is_disconnected():
                    return
                continue
            if kind == "text":  # content deltas: they concatenate to the final content
                yield chunk({"content": item})
                if await raw.is_disconnected():
                    return
            elif kind == "error":
                yield f"data: {json.dumps({'error': {'message': item.message, 'type': item.kind, 'param': item.param}})}\n\n"
                break
            else:
                result: ChatResult = item
                if result.tool_calls:
                    calls = [{"index": i, **c} for i, c in enumerate(result.tool_calls)]
                    yield chunk({"tool_calls": calls})
                yield chunk({}, finish=result.finish_reason)
                if include_usage:
                    usage = _usage(result, prepared.namespace, dropped_image_parts)
                    yield chunk({}, usage=usage)
                break
        yield "data: [DONE]\n\n"
    finally:  # finished, client gone, or cancelled by the server: stop decoding either way
        cancel.set()


def _openapi_request_schema() -> tuple[dict[str, Any], dict[str, Any]]:
    """JSON Schema of the chat-completions body for the OpenAPI spec (so fuzzers such as
    schemathesis can generate bodies), and the component schemas it refers to."""
    schema = ChatCompletionRequest.model_json_schema(
        ref_template="#/components/schemas/{model}", mode="validation"
    )
    defs = schema.pop("$defs", {})
    return schema, defs


_REQUEST_SCHEMA, _REQUEST_DEFS = _openapi_request_schema()


def _declare_schemas(app: FastAPI) -> None:
    base = app.openapi

    def openapi() -> dict[str, Any]:
        spec = base()
        spec.setdefault("components", {}).setdefault("schemas", {}).update(_REQUEST_DEFS)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    options: ServerOptions | None = None,
) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, options), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """Serve ``engine`` on ``host`` in a daemon thread (port 0: pick a free one).

    ``with BackgroundServer(engine) as srv: srv.base_url`` -> ``"http://127.0.0.1:PORT/v1"``.
    """

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        options: ServerOptions | None = None,
    ):
        import uvicorn

        self.config = uvicorn.Config(
            create_app(engine, options), host=host, port=port, log_level="warning"
        )
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("agentkv server failed to start")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
