"""A real OpenAI-compatible HTTP server on 127.0.0.1 that records request bodies.

``POST /v1/chat/completions`` answers with canned replies:

- when the request offers ``tools`` and its last message is a user message: a call of the
  first tool, every required argument set to ``"Paris"``;
- otherwise a text reply ``"reply <n>"``.

``stream: true`` requests get Server-Sent Events chunks. Every request is recorded (body,
start and end time); ``server.delay`` holds each response back (for concurrency tests).
``GET /v1/agentkv/capabilities`` answers ``server.capabilities`` when a test sets it, else 404
(like a server that is not an agentkv engine).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from agentkv import KVPayload, decode_payload


@dataclass
class Recorded:
    body: dict[str, Any]
    start: float
    end: float = 0.0

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]

    @property
    def payload(self) -> KVPayload | None:
        raw = (self.body.get("custom_params") or {}).get("agentkv")
        return None if raw is None else decode_payload(raw)

    def text(self) -> str:
        """All message contents joined (to find test markers)."""
        return " ".join(str(m.get("content")) for m in self.messages)


@dataclass
class RecordingServer:
    base_url: str
    requests: list[Recorded] = field(default_factory=list)
    delay: float = 0.0
    capabilities: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
        self.delay = 0.0
        self.capabilities = None


def _reply(body: dict[str, Any], n: int) -> tuple[dict[str, Any], str]:
    """(assistant message, finish_reason) for a request body."""
    last = body["messages"][-1]
    tools = body.get("tools") or []
    if tools and last.get("role") == "user":
        fn = tools[0]["function"]
        required = (fn.get("parameters") or {}).get("required") or []
        call = {
            "id": f"call_{n}",
            "type": "function",
            "function": {
                "name": fn["name"],
                "arguments": json.dumps(dict.fromkeys(required, "Paris")),
            },
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"role": "assistant", "content": f"reply {n}"}, "stop"


def _sse(message: dict[str, Any], finish: str, base: dict[str, Any]) -> bytes:
    delta: dict[str, Any] = {"role": "assistant"}
    if message.get("content"):
        delta["content"] = message["content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
    ]
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + b"data: [DONE]\n\n"


def _make_handler(server: RecordingServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            caps = server.capabilities
            if self.path.rstrip("/") == "/v1/agentkv/capabilities" and caps is not None:
                self._send(200, json.dumps(caps).encode(), "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def do_POST(self) -> None:  # noqa: N802 (http.server API)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length))
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, b'{"error": "not found"}', "application/json")
                return
            rec = Recorded(body=body, start=time.monotonic())
            with server.lock:
                server.requests.append(rec)
                n = len(server.requests)
            if server.delay:
                time.sleep(server.delay)
            message, finish = _reply(body, n)
            base = {
                "id": f"chatcmpl-{n}",
                "created": int(time.time()),
                "model": body.get("model", "test-model"),
            }
            if body.get("stream"):
                data = _sse(message, finish, {**base, "object": "chat.completion.chunk"})
                ctype = "text/event-stream"
            else:
                usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
                choice = {"index": 0, "message": message, "finish_reason": finish}
                resp = {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
                data = json.dumps(resp).encode()
                ctype = "application/json"
            rec.end = time.monotonic()
            self._send(200, data, ctype)

        def _send(self, status: int, data: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            # one connection per request: the SDKs' pooled async connections would otherwise
            # outlive the event loop of one asyncio.run() and break the next test's loop
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

    return Handler


@pytest.fixture(scope="session")
def _server() -> Iterator[RecordingServer]:
    rec = RecordingServer(base_url="")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(rec))
    httpd.daemon_threads = True
    rec.base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield rec
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server(_server: RecordingServer) -> Iterator[RecordingServer]:
    """The recording server, emptied for this test."""
    _server.clear()
    yield _server
    _server.clear()


def check_request(rec: Recorded, *, node: str | None, policy: Any, session_id: str) -> KVPayload:
    """Assert what arrived: payload node/policy/session, one annotation per message sent,
    same roles, and the actionable span (the trailing tool results, else the last user)."""
    payload = rec.payload
    assert payload is not None, f"no agentkv payload in {rec.body}"
    assert payload.node == node
    assert payload.policy == policy
    assert payload.session_id == session_id
    sent = rec.messages
    assert len(payload.messages) == len(sent)
    assert [a.index for a in payload.messages] == list(range(len(sent)))
    assert [a.role for a in payload.messages] == [m["role"] for m in sent]
    assert all(a.node == node for a in payload.messages)
    roles = [m["role"] for m in sent]
    last = max(i for i, r in enumerate(roles) if r in {"user", "tool"})
    span = {last}
    while roles[last] == "tool" and last > 0 and roles[last - 1] == "tool":
        last -= 1
        span.add(last)
    assert {a.index for a in payload.messages if a.actionable} == span
    return payload


@pytest.fixture
def check() -> Any:
    return check_request
