"""OpenAI-compatible HTTP server for the embedded engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions`` (non-streaming and SSE streaming, ``tools``,
tool-call parsing), ``GET /v1/models``, ``GET /health``, and agentkv's own
``GET/DELETE /v1/agentkv/sessions/{session_id}`` (session telemetry with a per-node
breakdown / end a session) and ``GET /v1/agentkv/capabilities`` (protocol version and the
policy methods this engine implements; clients warn about the others).

Every request is logged (logger ``agentkv.server``, INFO): session, node, policy, prompt
tokens and prefix hits, live and evicted KV, wall time.

The agentkv payload is read from ``custom_params["agentkv"]`` (absent -> FullCache; a
payload without message annotations gets them derived from the request's messages).
Responses carry ``usage.agentkv`` (:class:`agentkv.engine.telemetry.KVUsage`). Bad input ->
HTTP 400 with an OpenAI-style error naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentkv.cache import OutOfSlots
from agentkv.engine.capabilities import add_capabilities_route
from agentkv.engine.engine import (
    ChatResult,
    Engine,
    GenerationConfig,
    PreparedChat,
    RequestError,
)
from agentkv.engine.telemetry import KVUsage
from agentkv.wire import CUSTOM_PARAMS, WIRE_KEY, PayloadError, payload_from_request

log = logging.getLogger("agentkv.server")


PAYLOAD_PARAM = f"{CUSTOM_PARAMS}.{WIRE_KEY}"


class ChatMessage(BaseModel):
    """One request message (OpenAI format); validated for shape, passed on as sent."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


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
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    custom_params: dict[str, Any] | None = None


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error(status: int, message: str, param: str | None, kind: str) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": None}},
    )


def _message(result: ChatResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.tool_calls:
        msg["tool_calls"] = result.tool_calls
    return msg


def _usage(result: ChatResult) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "agentkv": u.model_dump(),
    }


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving ``engine``."""
    app = FastAPI(title="agentkv embedded engine", version="1")
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), None, kind)

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

    add_capabilities_route(app, engine)

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

    @app.get("/v1/agentkv/sessions/{session_id:path}")
    def session(session_id: str) -> dict[str, Any]:
        summary = engine.sessions.get(session_id)
        if summary is None:
            raise APIError(404, f"unknown session {session_id!r}", "session_id", "not_found_error")
        return {**summary.model_dump(), "prefix_hit_rate": summary.prefix_hit_rate}

    @app.delete("/v1/agentkv/sessions/{session_id:path}")
    def end_session(session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "slots_freed": engine.end_session(session_id)}

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Any:
        try:
            body = await raw.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = _loc_param(err["loc"], body, err["type"] == "missing")
            raise APIError(400, f"{field}: {err['msg']}", field) from None
        try:
            payload = payload_from_request(body)
        except PayloadError as e:
            param = e.field if e.field == CUSTOM_PARAMS else _payload_param(e.field)
            raise APIError(400, str(e), param) from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        gen = GenerationConfig(
            max_tokens=req.max_completion_tokens or req.max_tokens,  # None: engine default
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=stop,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        # validate, render and tag before answering, so bad input is a 400 even when streaming
        prepared = await asyncio.to_thread(_prepare, engine, body, payload, gen)
        if req.stream:
            include_usage = req.stream_options is None or req.stream_options.include_usage
            return StreamingResponse(
                _stream(engine, req, prepared, rid, include_usage),
                media_type="text/event-stream",
            )
        result = await asyncio.to_thread(_run, engine, prepared)
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
            "usage": _usage(result),
        }

    return app


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


def _loc_param(loc: tuple[Any, ...], data: Any, missing: bool) -> str:
    """Dotted path of a validation error in the request body, without pydantic's union-member
    tags (``messages.0.content``, not ``messages.0.content.str``)."""
    out: list[str] = []
    cur = data
    for i, seg in enumerate(loc):
        key = isinstance(cur, dict) and isinstance(seg, str) and seg in cur
        index = isinstance(cur, list) and isinstance(seg, int) and 0 <= seg < len(cur)
        if key or index:
            cur = cur[seg]
        elif not (missing and i == len(loc) - 1 and isinstance(cur, dict)):
            break  # a union-member tag, not a field (a missing required field is kept)
        out.append(str(seg))
    return ".".join(out) or "body"


def _payload_param(field: str | None) -> str:
    return f"{PAYLOAD_PARAM}.{field}" if field else PAYLOAD_PARAM


def _request_error(e: RequestError) -> APIError:
    field = e.field
    if field is not None and (field == "payload" or field.startswith("payload.")):
        field = _payload_param(field.partition(".")[2] or None)
    return APIError(400, str(e), field)


def _prepare(engine: Engine, body: dict[str, Any], payload, gen) -> PreparedChat:
    try:
        return engine.prepare_chat(body["messages"], body.get("tools") or None, payload, gen)
    except RequestError as e:
        raise _request_error(e) from None


def _run(engine: Engine, prepared: PreparedChat, on_text=None) -> ChatResult:
    try:
        result = engine.run_chat(prepared, on_text=on_text)
        log_request(result.usage)
        return result
    except RequestError as e:
        raise _request_error(e) from None
    except OutOfSlots as e:
        raise APIError(503, f"KV pool exhausted: {e}", None, "server_error") from None


async def _stream(
    engine, req, prepared: PreparedChat, rid: str, include_usage: bool
) -> AsyncIterator[str]:
    """SSE chunks in OpenAI's ``chat.completion.chunk`` format, then ``[DONE]``."""
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
    yield chunk({"role": "assistant", "content": ""})
    while True:
        kind, item = await queue.get()
        if kind == "text":  # content deltas: they concatenate to the final content
            yield chunk({"content": item})
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
                yield chunk({}, usage=_usage(result))
            break
    yield "data: [DONE]\n\n"


def serve(
    engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level)


class BackgroundServer:
    """Serve ``engine`` on ``host`` in a daemon thread (port 0: pick a free one).

    ``with BackgroundServer(engine) as srv: srv.base_url`` -> ``"http://127.0.0.1:PORT/v1"``.
    """

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.config = uvicorn.Config(create_app(engine), host=host, port=port, log_level="warning")
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
