"""Real request material for the method tests: a short airline conversation from tau-bench."""

from __future__ import annotations

import copy

import pytest


@pytest.fixture(scope="session")
def airline_request():
    """``(messages, tools)``: a real GPT-4o airline trajectory cut to a few hundred tokens.

    System prompt (the airline policy, truncated), two user turns, an assistant tool call,
    its (truncated) tool result, an assistant answer and the user's next question; the tool
    schemas of the two tools the conversation calls.
    """
    from agentkv.bench.traces import DEFAULT_TAU_BENCH, load_tau_bench

    if not DEFAULT_TAU_BENCH.is_file():
        pytest.skip(f"tau-bench data not found at {DEFAULT_TAU_BENCH}")
    trace = next(t for t in load_tau_bench() if t.id == "tau-bench/airline/0/0")
    m = copy.deepcopy(trace.messages)
    assert [x["role"] for x in m[:12]] == [
        "system", "user", "assistant", "user", "assistant", "user",
        "assistant", "tool", "assistant", "tool", "assistant", "user",
    ]  # fmt: skip
    assert m[6]["tool_calls"][0]["function"]["name"] == "get_user_details"
    messages = [
        dict(m[0], content=m[0]["content"][:300]),
        m[1],
        m[2],
        m[3],
        m[6],
        dict(m[7], content=m[7]["content"][:200]),
        dict(m[10], content=m[10]["content"][:160]),
        m[11],
    ]
    tools = [t for t in trace.tools if t["function"]["name"] in {"get_user_details"}]
    return messages, tools


@pytest.fixture(scope="session")
def airline_cached(engine, airline_request):
    """:func:`airline_request`, computed once without compression so that it sits in the
    engine's shared prefix cache: later requests on it compute only their new tokens (the
    engine never reuses an actionable query for methods that observe prefill)."""
    from agentkv import FullCache, build_payload
    from agentkv.engine.engine import GenerationConfig

    messages, tools = airline_request
    payload = build_payload(messages, FullCache(), "x:methods-warmup")
    engine.chat(messages, tools, payload=payload, gen=GenerationConfig(max_tokens=1))
    engine.end_session("x:methods-warmup")
    return messages, tools
