"""agentkv.usage() on every carrier of the engine's telemetry, and the per-node aggregate."""

from __future__ import annotations

import pytest

import agentkv

TELEMETRY = {"method": "h2o", "policy": "h2o(budget=32)", "node": "act", "prompt_tokens": 10}


def test_usage_from_openai_objects_and_dicts() -> None:
    openai_types = pytest.importorskip("openai.types.chat")
    body = {
        "id": "c",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "total_tokens": 11,
            "agentkv": TELEMETRY,
        },
    }
    completion = openai_types.ChatCompletion.model_validate(body)
    assert agentkv.usage(completion) == TELEMETRY
    assert agentkv.usage(completion.usage) == TELEMETRY
    assert agentkv.usage(body) == TELEMETRY
    chunk = openai_types.ChatCompletionChunk.model_validate(
        {**body, "object": "chat.completion.chunk", "choices": []}
    )
    assert agentkv.usage(chunk) == TELEMETRY
    no_usage = {**body, "usage": None}
    assert agentkv.usage(openai_types.ChatCompletion.model_validate(no_usage)) is None


def test_usage_from_langchain_messages() -> None:
    messages = pytest.importorskip("langchain_core.messages")
    streamed = messages.AIMessage("hi", response_metadata={"agentkv": TELEMETRY})
    plain = messages.AIMessage("hi", response_metadata={"token_usage": {"agentkv": TELEMETRY}})
    other = messages.AIMessage("hi", response_metadata={"token_usage": {"prompt_tokens": 3}})
    assert agentkv.usage(streamed) == agentkv.usage(plain) == TELEMETRY
    assert agentkv.usage(other) is None
    assert agentkv.usage(messages.AIMessageChunk("")) is None


def test_usage_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="expects a LangChain AIMessage"):
        agentkv.usage(42)


def test_aggregate_by_node() -> None:
    rows = agentkv.aggregate_by_node(
        [
            {**TELEMETRY, "prefix_hit_tokens": 0, "live_kv_tokens": 8.0, "wall_time_s": 0.5},
            {**TELEMETRY, "prefix_hit_tokens": 5, "live_kv_tokens": 6.0, "wall_time_s": 0.25},
            {"policy": "full()", "node": None, "prompt_tokens": 4, "live_kv_tokens": 4.0},
        ]
    )
    assert set(rows) == {"act", "-"}
    act = rows["act"]
    assert act["requests"] == 2 and act["policies"] == ["h2o(budget=32)"]
    assert act["prompt_tokens"] == 20 and act["prefix_hit_tokens"] == 5
    assert act["prefix_hit_rate"] == 0.25
    assert act["peak_live_kv_tokens"] == 8.0 and act["wall_time_s"] == 0.75
    assert rows["-"]["requests"] == 1
