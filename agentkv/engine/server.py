"""OpenAI-compatible HTTP server for the embedded engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/chat/completions`` (non-streaming and SSE streaming, ``tools``,
tool-call parsing), ``GET /v1/models``, ``GET /health``, and agentkv's own
``GET/DELETE /v1/agentkv/sessions/{session_id}`` (session telemetry / end a session).

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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentkv.cache import OutOfSlots
from agentkv.engine.engine import ChatResult, Engine, GenerationConfig, RequestError
from agentkv.wire import PayloadError, payload_from_request

log = logging.getLogger("agentkv.server")


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat-completions request the engine honours (others ignored)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    custom_params: dict[str, Any] | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
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

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {err['msg']}", ".".join(loc) or None, "invalid_request_error")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "agentkv"}],
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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            raise APIError(400, f"{field}: {err['msg']}", field) from None
        try:
            payload = payload_from_request(body)
        except PayloadError as e:
            raise APIError(400, str(e), f"custom_params.agentkv.{e.field}" if e.field else "custom_params.agentkv") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        gen = GenerationConfig(
            max_tokens=req.max_completion_tokens or req.max_tokens or 256,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=stop,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage", True))
            return StreamingResponse(
                _stream(engine, req, payload, gen, rid, include_usage),
                media_type="text/event-stream",
            )
        result = await asyncio.to_thread(_run, engine, req, payload, gen)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or engine.model_name,
            "choices": [{"index": 0, "message": _message(result), "finish_reason": result.finish_reason, "logprobs": None}],
            "usage": _usage(result),
        }

    return app


def _run(engine: Engine, req: ChatCompletionRequest, payload, gen, on_text=None) -> ChatResult:
    try:
        return engine.chat(req.messages, req.tools, payload, gen, on_text=on_text)
    except RequestError as e:
        raise APIError(400, str(e), e.field) from None
    except OutOfSlots as e:
        raise APIError(503, f"KV pool exhausted: {e}", None, "server_error") from None


async def _stream(engine, req, payload, gen, rid: str, include_usage: bool) -> AsyncIterator[str]:
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
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if usage is None else [],
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def work() -> None:
        try:
            result = _run(engine, req, payload, gen, on_text=lambda t: loop.call_soon_threadsafe(queue.put_nowait, ("text", t)))
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
        except APIError as e:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", e))
        except Exception as e:  # keep serving; report in-band
            log.exception("stream failed")
            loop.call_soon_threadsafe(queue.put_nowait, ("error", APIError(500, str(e), None, "server_error")))

    threading.Thread(target=work, daemon=True).start()
    yield chunk({"role": "assistant", "content": ""})
    streamed_text = False
    while True:
        kind, item = await queue.get()
        if kind == "text":
            streamed_text = True
            yield chunk({"content": item})
        elif kind == "error":
            yield f"data: {json.dumps({'error': {'message': item.message, 'type': item.kind, 'param': item.param}})}\n\n"
            break
        else:
            result: ChatResult = item
            if result.tool_calls:
                calls = [{"index": i, **c} for i, c in enumerate(result.tool_calls)]
                yield chunk({"tool_calls": calls})
            elif not streamed_text and result.content:
                yield chunk({"content": result.content})
            yield chunk({}, finish=result.finish_reason)
            if include_usage:
                yield chunk({}, usage=_usage(result))
            break
    yield "data: [DONE]\n\n"


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
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
