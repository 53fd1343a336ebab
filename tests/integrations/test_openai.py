"""kv_client on real openai.OpenAI / AsyncOpenAI clients against the recording server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from agentkv import IntentKV, KVzap, build_payload, encode_payload, resolve_session_id
from agentkv.integrations.openai import kv_client

POLICY = IntentKV(budget=512)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def sync_client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def async_client(server: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_sync_create(server: Any, check: Any) -> None:
    base = sync_client(server)
    client = kv_client(base, policy=POLICY, session_id="s1")
    assert isinstance(client, openai.OpenAI) and client is not base
    resp = client.chat.completions.create(model="m", messages=MESSAGES)
    assert resp.choices[0].message.content == "reply 1"
    payload = check(server.requests[0], node=None, policy=POLICY, session_id="s1")
    assert [a.turn for a in payload.messages] == [0, 0, 0, 1]
    # the wrapped-from client is untouched
    base.chat.completions.create(model="m", messages=MESSAGES)
    assert "custom_params" not in server.requests[1].body


def test_session_from_messages_and_node(server: Any, check: Any) -> None:
    client = kv_client(sync_client(server), policy=KVzap(threshold=-4), node="browse")
    client.chat.completions.create(model="m", messages=MESSAGES)
    client.chat.completions.create(model="m", messages=MESSAGES[:2])  # same opening
    sid = resolve_session_id(messages=MESSAGES)
    assert sid.startswith("task:")
    for rec in server.requests:
        check(rec, node="browse", policy=KVzap(threshold=-4), session_id=sid)


def test_merges_user_extra_body(server: Any, check: Any) -> None:
    client = kv_client(sync_client(server), policy=POLICY, session_id="s1")
    extra = {"top_k": 7, "custom_params": {"tenant": "acme"}}
    client.chat.completions.create(model="m", messages=MESSAGES, extra_body=extra)
    rec = server.requests[0]
    check(rec, node=None, policy=POLICY, session_id="s1")
    assert rec.body["top_k"] == 7 and rec.body["custom_params"]["tenant"] == "acme"
    assert extra == {"top_k": 7, "custom_params": {"tenant": "acme"}}  # caller's dict unchanged


def test_explicit_payload_wins(server: Any) -> None:
    client = kv_client(sync_client(server), policy=POLICY, session_id="s1")
    mine = encode_payload(build_payload(MESSAGES, KVzap(), "mine"))
    client.chat.completions.create(
        model="m", messages=MESSAGES, extra_body={"custom_params": {"agentkv": mine}}
    )
    assert server.requests[0].payload.session_id == "mine"


def test_stream_raw_and_generator_messages(server: Any, check: Any) -> None:
    client = kv_client(sync_client(server), policy=POLICY, session_id="s1")
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert chunks[0].choices[0].delta.content == "reply 1"
    raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    assert raw.parse().choices[0].message.content == "reply 2"
    with client.chat.completions.stream(model="m", messages=MESSAGES) as stream:
        assert stream.get_final_completion().choices[0].message.content == "reply 3"
    client.chat.completions.create(model="m", messages=(m for m in MESSAGES))  # one-shot iterable
    assert len(server.requests) == 4
    for rec in server.requests:
        check(rec, node=None, policy=POLICY, session_id="s1")
        assert rec.messages == MESSAGES


def test_async_client(server: Any, check: Any) -> None:
    async def main() -> None:
        client = kv_client(async_client(server), policy=POLICY, session_id="s2")
        assert isinstance(client, openai.AsyncOpenAI)
        await client.chat.completions.create(model="m", messages=MESSAGES)
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        assert [c async for c in stream]
        other = kv_client(async_client(server), policy=KVzap(), session_id="s3")
        server.delay = 0.05
        await asyncio.gather(
            *(c.chat.completions.create(model="m", messages=MESSAGES) for c in (client, other) * 2)
        )

    asyncio.run(main())
    assert len(server.requests) == 6
    for rec in server.requests[:2]:
        check(rec, node=None, policy=POLICY, session_id="s2")
    by_session: dict[str, list[Any]] = {}
    for rec in server.requests[2:]:
        by_session.setdefault(rec.payload.session_id, []).append(rec.payload.policy)
    assert by_session == {"s2": [POLICY, POLICY], "s3": [KVzap(), KVzap()]}


def test_wire_format(server: Any) -> None:
    client = kv_client(sync_client(server), policy=POLICY, session_id="s1")
    client.chat.completions.create(model="m", messages=MESSAGES)
    params = server.requests[0].body["custom_params"]
    assert set(params) == {"agentkv"} and isinstance(params["agentkv"], str)
    assert json.loads(params["agentkv"])["version"] == 1


def test_rejects_other_objects() -> None:
    with pytest.raises(TypeError):
        kv_client(object(), policy=POLICY)  # type: ignore[type-var]
