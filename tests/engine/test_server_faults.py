"""Faults a hostile or careless client causes: malformed messages (every field, wrong types),
oversized bodies, unsupported options, abandoned requests and requests the KV pool cannot
hold. Each is a clean 4xx/5xx naming the problem, and the server keeps serving."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")

# a prompt SmolLM2 answers at length (greedy): runs that stop early were cut short by us
LONG_ANSWER = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]

USER = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
ASSISTANT = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "thinking",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}
TOOL = {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}

# every message field -> (a message where it is valid, values of a wrong type / shape)
MESSAGE_FIELDS: dict[str, tuple[dict[str, Any], list[Any]]] = {
    "role": (USER, [5, 1.5, True, None, [], {}, "robot"]),
    "content": (USER, [5, 1.5, True, {}]),
    "content.0": (USER, [5, 1.5, True, None, []]),
    "content.0.type": (USER, [5, True, None, [], {}]),
    "content.0.text": (USER, [5, 1.5, True, [], {}]),
    "name": (TOOL, [5, True, [], {}]),
    "tool_calls": (ASSISTANT, [5, "x", True, {}]),
    "tool_calls.0": (ASSISTANT, [5, "f", None, [], True]),
    "tool_calls.0.id": (ASSISTANT, [5, True, [], {}]),
    "tool_calls.0.type": (ASSISTANT, [5, "web", None, []]),
    "tool_calls.0.function": (ASSISTANT, ["f", 5, None, [], True]),
    "tool_calls.0.function.name": (ASSISTANT, [5, None, "", [], {}]),
    "tool_calls.0.function.arguments": (ASSISTANT, [5, None, True, [], 1.5]),
    "tool_call_id": (TOOL, [5, True, [], {}]),
    "reasoning_content": (ASSISTANT, [5, True, [], {}]),
}


def with_field(message: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    msg = copy.deepcopy(message)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    cur: Any = msg
    for p in parents:
        cur = cur[p]
    cur[last] = value
    return msg


SWEEP = [
    (f"{field}={json.dumps(value)}", field, with_field(base, field, value))
    for field, (base, values) in MESSAGE_FIELDS.items()
    for value in values
]


@pytest.mark.parametrize(("field", "message"), [c[1:] for c in SWEEP], ids=[c[0] for c in SWEEP])
def test_every_message_field_with_a_wrong_type_is_a_400_naming_it(http, field, message):
    body = {"model": "m", "messages": [message], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == f"messages.0.{field}", err


def test_sweep_size_and_the_valid_bases(http):
    """The bases are valid (so each case fails on its one field), and the sweep is broad."""
    assert len(SWEEP) >= 60
    messages = [{"role": "system", "content": "Be brief."}, USER, ASSISTANT, TOOL]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_the_issue_500_is_a_400_and_the_connection_survives(http):
    """``tool_calls: [{"function": "f"}]`` was an HTTP 500 that reset the keep-alive
    connection."""
    bad = {"role": "assistant", "tool_calls": [{"function": "f"}]}
    body = {"messages": [{"role": "user", "content": "hi"}, bad], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.tool_calls.0.function"
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert http.post("/v1/chat/completions", json=good).status_code == 200


# ------------------------------------------------------------------ size limit
def test_oversized_body_is_a_413_before_parsing(http):
    huge = {"messages": [{"role": "user", "content": "x" * (2 << 20)}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=huge)
    assert r.status_code == 413, r.text
    assert "1048576 bytes" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}]}'

    r = http.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert http.get("/health").status_code == 200


# -------------------------------------------------------------- smaller items
def test_405_names_the_allowed_methods(http):
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    r = http.put("/v1/agentkv/sessions/x")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_openapi_declares_the_chat_request_body(http):
    spec = http.get("/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    schema = body["content"]["application/json"]["schema"]
    assert body["required"] and {"messages", "max_tokens", "cache_salt"} <= set(
        schema["properties"]
    )

    def refs(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if "$ref" in node:
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    names = set(spec["components"]["schemas"])
    found = set(refs(spec))
    assert "#/components/schemas/ChatMessage" in found
    assert {r.removeprefix("#/components/schemas/") for r in found} <= names


def test_stop_list_too_long_says_so(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": [str(i) for i in range(17)]}
    err = http.post("/v1/chat/completions", json=body).json()["error"]
    assert err["param"] == "stop" and "at most 16" in err["message"], err


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
)
def test_media_content_is_a_400_for_a_text_model(http, part):
    content = [{"type": "text", "text": "What is this?"}, part]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.1" and "text only" in err["message"], err


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def test_image_parts_are_dropped_and_counted_for_a_text_model(http):
    """The text-only model never sees an image: the prompt is the text alone (same tokens as
    without the images) and the response says how many image parts were dropped."""
    text = {"type": "text", "text": "What is on the screen?"}
    tool_call = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": [text, IMAGE]},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "c1", "content": [IMAGE, {"type": "text", "text": "ok"}]},
    ]
    without = [
        {**m, "content": [p for p in m["content"] if p is not IMAGE]}
        if isinstance(m["content"], list)
        else m
        for m in msgs
    ]
    got = {}
    for name, messages in (("with", msgs), ("without", without)):
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        got[name] = r.json()["usage"]
    assert got["with"]["agentkv"]["dropped_image_parts"] == 2
    assert got["without"]["agentkv"]["dropped_image_parts"] == 0
    assert got["with"]["prompt_tokens"] == got["without"]["prompt_tokens"]


def test_image_parts_are_a_400_when_the_server_rejects_them(engine):
    httpx = pytest.importorskip("httpx")
    from agentkv.engine.server import create_app
    from agentkv.engine.tenancy import ServerOptions

    app = create_app(engine, ServerOptions(image_parts="reject"))
    transport = httpx.ASGITransport(app=app)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            content = [{"type": "text", "text": "What is this?"}, IMAGE]
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(post())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.1" and "text only" in err["message"], err


def test_tool_choice_required_or_named_is_a_400_none_hides_the_tools(http):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    base = {"messages": [{"role": "user", "content": "Time?"}], "tools": [tool], "max_tokens": 1}
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        r = http.post("/v1/chat/completions", json={**base, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    usage = {}
    for choice in ("auto", "none"):
        r = http.post("/v1/chat/completions", json={**base, "tool_choice": choice})
        assert r.status_code == 200, r.text
        usage[choice] = r.json()["usage"]["prompt_tokens"]
    assert usage["none"] < usage["auto"]  # the tool schemas were not rendered


def test_tiny_temperature_decodes_greedily(http):
    """Found by the schemathesis fuzz: ``temperature=1e-300`` made the logits inf and
    sampling raise (HTTP 500). Below 1e-5 it decodes greedily, as vLLM does."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    greedy = http.post("/v1/chat/completions", json=body).json()
    for t in (1e-300, 5e-324, 1e-6):
        r = http.post("/v1/chat/completions", json={**body, "temperature": t})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]


# ---------------------------------------------------------------- cancellation
def wait_idle(engine, session_prefix: str, timeout: float = 60.0):
    """The request log entry of the (only) request of a session, once the engine is idle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = [u for u in list(engine.request_log) if u.session_id.startswith(session_prefix)]
        if hits and engine.store.stats().num_requests == 0:
            return hits
        time.sleep(0.05)
    raise AssertionError("the request did not finish")


def long_request(sid: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    p = {"version": 1, "session_id": sid, "policy": {"method": "full"}}
    return {
        "messages": LONG_ANSWER,
        "max_tokens": max_tokens,
        "custom_params": {"agentkv": json.dumps(p)},
        **extra,
    }


MAX = 64


@pytest.fixture(scope="module")
def runs_to_max(server) -> None:
    """Uncancelled, the long-answer request decodes all ``MAX`` tokens (so a shorter run in
    the tests below was cut short by the disconnect)."""
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        r = c.post("/chat/completions", json=long_request("uncancelled", MAX))
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == MAX


def test_stream_disconnect_cancels_generation(server, engine, runs_to_max, sid):
    with (
        httpx.Client(base_url=server.base_url, timeout=300) as c,
        c.stream("POST", "/chat/completions", json=long_request(sid, MAX, stream=True)) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # the first content delta: walk away
    (usage,) = wait_idle(engine, f"{sid}@")
    assert 1 <= usage.completion_tokens < MAX
    engine.store.check_invariants()


def test_disconnect_cancels_a_non_streaming_request(server, engine, http, runs_to_max, sid):
    timeout = httpx.Timeout(300, read=0.5)
    with (
        httpx.Client(base_url=server.base_url, timeout=timeout) as c,
        pytest.raises(httpx.ReadTimeout),
    ):
        c.post("/chat/completions", json=long_request(sid, MAX))
    (usage,) = wait_idle(engine, f"{sid}@")
    assert usage.completion_tokens < MAX
    engine.store.check_invariants()
    # the session goes on: its next turn reuses the cached prompt
    r = http.post("/v1/chat/completions", json=long_request(sid, 1))
    assert r.status_code == 200 and r.json()["usage"]["agentkv"]["prefix_hit_tokens"] > 0


def test_engine_should_stop_hook(engine, sid):
    """The engine's cancel hook: polled before prefill (a request cancelled while it waited
    for the engine never starts) and before each decode step (``finish_reason="abort"``)."""
    from agentkv.engine.engine import GenerationConfig, RequestCancelled
    from agentkv.wire import KVPayload

    payload = KVPayload(session_id=sid)
    logged = len(engine.request_log)
    gen = GenerationConfig(max_tokens=MAX, should_stop=lambda: True)
    with pytest.raises(RequestCancelled):
        engine.chat(LONG_ANSWER, payload=payload, gen=gen)
    assert len(engine.request_log) == logged and engine.store.stats().num_requests == 0
    polls = []

    def stop_at_fourth_poll() -> bool:
        polls.append(1)
        return len(polls) >= 4

    gen = GenerationConfig(max_tokens=MAX, should_stop=stop_at_fourth_poll)
    result = engine.chat(LONG_ANSWER, payload=payload, gen=gen)
    # poll 1: before prefill; polls 2, 3: before tokens 1, 2; poll 4: stop
    assert result.finish_reason == "abort" and len(result.token_ids) == 2
    assert engine.request_log[-1].completion_tokens == 2
    engine.store.check_invariants()
    engine.end_session(sid)


# ---------------------------------------------------------- admission control
SMALL_POOL = 128


@pytest.fixture(scope="module")
def small() -> Iterator[tuple[Any, Any]]:
    """An engine whose KV pool (127 usable slots) is far below the model's context, served."""
    from agentkv.engine.engine import Engine
    from agentkv.engine.server import BackgroundServer

    eng = Engine(device="cpu", kv_slots=SMALL_POOL, chunk_size=64)
    with (
        BackgroundServer(eng) as srv,
        httpx.Client(base_url=srv.base_url.removesuffix("/v1"), timeout=300) as c,
    ):
        yield eng, c


def test_request_that_can_never_fit_the_pool_is_a_400_before_prefill(small):
    eng, c = small
    words = " ".join(["apple"] * 200)  # ~200 tokens: within the context, over the pool
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": words}], "stream": stream}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "KV pool (127 token slots" in err["message"], err
    body = {"messages": LONG_ANSWER, "max_tokens": 120}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert eng.store.stats().free_slots == eng.store.stats().capacity  # nothing was prefilled


def test_default_max_tokens_is_clipped_to_the_pool(small):
    eng, c = small
    # a long prompt leaves the answer a few dozen of the pool's 127 slots (fewer decode steps)
    system = {"role": "system", "content": "You are a careful assistant who counts. " * 9}
    r = c.post("/v1/chat/completions", json={"messages": [system, *LONG_ANSWER]})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] <= eng.kv_capacity
    assert r.json()["choices"][0]["finish_reason"] == "length"


def hold(eng, n: int):
    """A request that holds ``n`` pool slots (another in-flight user of the pool)."""
    req = eng.store.begin_request(None, [7] * n)
    eng.store.extend(req)
    return req


def test_running_out_during_decode_returns_what_was_generated(small):
    eng, c = small
    eng.flush_prefix_cache()
    body = {"messages": LONG_ANSWER, "max_tokens": 40}
    prompt = c.post("/v1/chat/completions", json={**body, "max_tokens": 1}).json()["usage"]
    eng.flush_prefix_cache()
    blocker = hold(eng, eng.kv_capacity - prompt["prompt_tokens"] - 5)
    try:
        r = c.post("/v1/chat/completions", json=body)
    finally:
        eng.store.finish_request(blocker, cache=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 6
    eng.store.check_invariants()


def test_no_room_now_is_a_503_with_retry_after_and_is_never_cached(small):
    eng, c = small
    eng.flush_prefix_cache()
    blocker = hold(eng, eng.kv_capacity - 4)
    body = {"messages": LONG_ANSWER, "max_tokens": 2}
    try:
        r = c.post("/v1/chat/completions", json=body)
    finally:
        eng.store.finish_request(blocker, cache=False)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    stats = eng.store.stats()
    assert stats.prefix_cache_nodes == 0 and stats.free_slots == stats.capacity
    eng.store.check_invariants()
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["agentkv"]["prefix_hit_tokens"] == 0
