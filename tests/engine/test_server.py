"""The OpenAI-compatible server on the real engine, through the real ``openai`` SDK."""

from __future__ import annotations

import json

import pytest

from agentkv import build_payload, to_extra_body
from agentkv.policies import FullCache, IntentKV
from agentkv.wire import KVPayload, encode_payload

from .chats import WEATHER_TOOL, tool_call_fewshot

pytestmark = pytest.mark.slow

USAGE_FIELDS = {
    "method",
    "policy",
    "session_id",
    "node",
    "prompt_tokens",
    "completion_tokens",
    "prefix_hit_tokens",
    "prefix_hit_rate",
    "peak_request_tokens",
    "live_kv_tokens",
    "live_kv_bytes",
    "resident_kv_tokens",
    "resident_kv_bytes",
    "evicted_tokens",
    "evicted_entries",
    "raw_kv_reads",
    "effective_kv_reads",
    "wall_time_s",
}


def agentkv_usage(usage) -> dict:
    """``usage.agentkv`` of an SDK response or chunk (an extra field the SDK keeps)."""
    assert usage is not None
    data = usage.model_dump()
    assert "agentkv" in data, data
    ak = data["agentkv"]
    assert set(ak) >= USAGE_FIELDS, USAGE_FIELDS - set(ak)
    assert ak["prompt_tokens"] == usage.prompt_tokens
    assert ak["completion_tokens"] == usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    return ak


def user(text: str, sid: str) -> list[dict]:
    return [{"role": "system", "content": f"{sid}: be brief."}, {"role": "user", "content": text}]


def test_health_and_models(http, client, engine):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    assert models.data[0].owned_by == "agentkv"


def test_unknown_route_is_openai_style_404(http):
    r = http.get("/v1/nope")
    assert r.status_code == 404
    assert set(r.json()["error"]) >= {"message", "type", "param"}


def test_chat_without_payload_is_full_cache(client, sid):
    resp = client.chat.completions.create(
        model="anything", messages=user("Say hi.", sid), max_tokens=5
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    assert resp.model == "anything" and resp.object == "chat.completion"
    ak = agentkv_usage(resp.usage)
    assert ak["method"] == "full" and ak["evicted_tokens"] == 0
    assert ak["session_id"].startswith("task:")  # derived from the messages
    assert resp.usage.completion_tokens <= 5


def test_stream_reassembles_to_non_streaming(client, sid):
    messages = user("Describe the sea in one sentence.", sid)
    payload = to_extra_body(KVPayload(session_id=sid, policy=FullCache()))
    full = client.chat.completions.create(
        model="m", messages=messages, max_tokens=12, extra_body=payload
    )
    chunks = list(
        client.chat.completions.create(
            model="m", messages=messages, max_tokens=12, stream=True, extra_body=payload
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == []
    ak = agentkv_usage(last.usage)
    assert ak["session_id"] == sid
    assert ak["completion_tokens"] == full.usage.completion_tokens
    # the second request reused the first one's prefix
    assert ak["prefix_hit_tokens"] >= full.usage.prompt_tokens - 1


def test_stream_honours_stop_strings(client, sid):
    messages = user("Count from one to ten in words.", sid)
    kw = dict(model="m", messages=messages, max_tokens=16)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert len(plain) >= 12, plain
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]  # likely spans tokens
    expected = plain[: plain.index(stop)]
    full = client.chat.completions.create(**kw, stop=["never-appears", stop])
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens < 16
    chunks = list(client.chat.completions.create(**kw, stop=stop, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_payload_from_build_payload_is_honoured(client, sid):
    messages = user("Name a color.", sid)
    policy = IntentKV(budget=16, memory_decay=0.7)
    payload = build_payload(messages, policy, session_id=sid, node="planner")
    resp = client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, extra_body=to_extra_body(payload)
    )
    ak = agentkv_usage(resp.usage)
    assert ak["method"] == "intentkv"
    assert ak["policy"] == policy.describe()
    assert ak["session_id"] == sid
    assert ak["node"] == "planner"


def test_payload_without_annotations_is_derived(client, engine, sid):
    """A plain client that only names a policy: ``messages: null`` in the payload."""
    history = [
        {"role": "system", "content": f"{sid}: be brief."},
        {"role": "user", "content": "My name is Ana and I live in Lisbon, Portugal."},
        {"role": "assistant", "content": "Nice to meet you, Ana from Lisbon!"},
        {"role": "user", "content": "What is my name?"},
    ]
    raw = json.dumps(
        {
            "version": 1,
            "session_id": sid,
            "policy": {"method": "intentkv", "budget": 2},
            "messages": None,
        }
    )
    resp = client.chat.completions.create(
        model="m",
        messages=history,
        max_tokens=3,
        extra_body={"custom_params": {"agentkv": raw}},
    )
    ak = agentkv_usage(resp.usage)
    assert ak["method"] == "intentkv" and ak["session_id"] == sid and ak["node"] is None
    # derived annotations: the system block and the last user message are forced; the
    # earlier exchange is history. The budget (2) is the total live KV and the forced set
    # alone exceeds it, so all the history goes
    tags = engine.renderer.encode(history)
    history_tokens = len(tags) - sum(tags.forced(True))
    assert history_tokens > 2 and sum(tags.forced(True)) > 2
    assert ak["evicted_tokens"] == history_tokens


def test_tools_are_rendered(client, sid):
    messages = user("Hello there.", sid)
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    with_tools = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=1
    )
    grown = with_tools.usage.prompt_tokens - plain.usage.prompt_tokens
    schema_tokens = len(json.dumps(WEATHER_TOOL)) // 8
    assert grown > schema_tokens, (grown, schema_tokens)


def test_tool_call_reply_is_parsed(client, sid):
    messages = tool_call_fewshot("Paris")
    extra = to_extra_body(build_payload(messages, FullCache(), session_id=sid))
    resp = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER_TOOL], max_tokens=30, extra_body=extra
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # streaming: no <tool_call> text in the content deltas, the call arrives as a delta
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            tools=[WEATHER_TOOL],
            max_tokens=30,
            stream=True,
            extra_body=extra,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ""
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    # the call goes back into the conversation with its result: the next turn renders it
    follow = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"},
    ]
    extra = to_extra_body(build_payload(follow, FullCache(), session_id=sid))
    resp2 = client.chat.completions.create(
        model="m", messages=follow, tools=[WEATHER_TOOL], max_tokens=8, extra_body=extra
    )
    ak = agentkv_usage(resp2.usage)
    assert ak["prefix_hit_tokens"] >= resp.usage.prompt_tokens - 1


def test_session_endpoint(client, http, sid):
    sid = f"lg:{sid}/agent"  # LangGraph-style ids carry ':' and '/'
    payload = KVPayload(session_id=sid, policy=FullCache(), node="n1")
    messages = user("Name a fruit.", sid)
    usages = []
    for _ in range(2):
        resp = client.chat.completions.create(
            model="m", messages=messages, max_tokens=3, extra_body=to_extra_body(payload)
        )
        usages.append(agentkv_usage(resp.usage))
    r = http.get(f"/v1/agentkv/sessions/{sid}")
    assert r.status_code == 200
    s = r.json()
    assert s["session_id"] == sid and s["requests"] == 2 and s["nodes"] == ["n1"]
    assert s["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert s["prefix_hit_tokens"] == sum(u["prefix_hit_tokens"] for u in usages) > 0
    assert s["prefix_hit_rate"] == pytest.approx(s["prefix_hit_tokens"] / s["prompt_tokens"])
    assert s["peak_request_tokens"] == max(u["peak_request_tokens"] for u in usages)
    assert s["peak_live_kv_tokens"] == max(u["live_kv_tokens"] for u in usages)
    assert s["raw_kv_reads"] == sum(u["raw_kv_reads"] for u in usages)
    assert s["effective_kv_reads"] == sum(u["effective_kv_reads"] for u in usages)
    assert s["wall_time_s"] == pytest.approx(sum(u["wall_time_s"] for u in usages), abs=1e-3)

    assert http.delete(f"/v1/agentkv/sessions/{sid}").status_code == 200
    r = http.get(f"/v1/agentkv/sessions/{sid}")
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "session_id"


def test_kv_client_integration_end_to_end(server, sid):
    """The OpenAI integration's ``kv_client`` against the real engine."""
    openai = pytest.importorskip("openai")
    from agentkv.integrations.openai import kv_client

    base = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with base:
        c = kv_client(base, IntentKV(budget=32), session_id=sid, node="agent")
        resp = c.chat.completions.create(model="m", messages=user("Hi!", sid), max_tokens=2)
    ak = agentkv_usage(resp.usage)
    assert ak["method"] == "intentkv" and ak["node"] == "agent"
    assert sid in ak["session_id"]


def test_raw_payload_dict_and_string_forms(http, sid):
    """``custom_params.agentkv`` as the JSON string clients send, or as an object."""
    body = {"model": "m", "messages": user("Hi.", sid), "max_tokens": 1}
    p = {"version": 1, "session_id": sid, "policy": {"method": "full"}}
    for value in (json.dumps(p), p, encode_payload(KVPayload(session_id=sid))):
        r = http.post("/v1/chat/completions", json={**body, "custom_params": {"agentkv": value}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["agentkv"]["session_id"] == sid
