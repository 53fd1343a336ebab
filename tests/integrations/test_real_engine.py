"""The integrations against the real engine over HTTP on 127.0.0.1 (SmolLM2, CPU): telemetry
readable from every message (streamed or not), per node for a run and per session on the
server; capabilities warnings; call-time policies; unreachable-server errors."""

from __future__ import annotations

import asyncio
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

import agentkv
from agentkv import (
    H2O,
    FullCache,
    IntentKV,
    KVzap,
    SnapKV,
    TriAxialKV,
    UniformQuant,
    UnimplementedPolicyWarning,
)
from agentkv.integrations.langchain import KVPolicyMiddleware
from agentkv.integrations.langgraph import (
    KVUsageCallbackHandler,
    get_kv_usage_callback,
    with_kv_policy,
)
from agentkv.integrations.openai import kv_client

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def engine_url(engine: Any) -> Iterator[str]:
    """The shared real engine served on 127.0.0.1."""
    from agentkv.engine.server import BackgroundServer

    with BackgroundServer(engine) as srv:
        yield srv.base_url


def chat(url: str, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(model="smollm2", base_url=url, api_key="x", max_tokens=4, max_retries=0, **kw)


def two_nodes(llm: ChatOpenAI, context_schema: Any = None) -> StateGraph:
    def browse(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage("Browse."), *state["messages"]])]}

    def act(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage("Act."), *state["messages"]])]}

    builder = StateGraph(MessagesState, context_schema=context_schema)
    builder.add_node("browse", browse)
    builder.add_node("act", act)
    builder.add_edge(START, "browse")
    builder.add_edge("browse", "act")
    return builder


def ask(text: str) -> dict[str, Any]:
    return {"messages": [HumanMessage(text)]}


def session(url: str, sid: str) -> dict[str, Any]:
    r = httpx.get(url.removesuffix("/v1") + f"/v1/agentkv/sessions/{sid}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("streaming", [False, True])
def test_telemetry_on_messages_per_node_and_per_session(engine_url: str, streaming: bool) -> None:
    tid = f"tele-{streaming}"
    app = with_kv_policy(
        two_nodes(chat(engine_url, streaming=streaming)),
        default=FullCache(),
        nodes={"act": H2O(budget=16, recent=4)},
        checkpointer=InMemorySaver(),
    )
    report = KVUsageCallbackHandler()
    out = app.invoke(
        ask("Find a cheap flight."),
        {"configurable": {"thread_id": tid}, "callbacks": [report]},
    )
    browse_msg, act_msg = out["messages"][1:]
    for msg, node, method in ((browse_msg, "browse", "full"), (act_msg, "act", "h2o")):
        assert isinstance(msg, AIMessage)
        u = agentkv.usage(msg)
        assert u is not None, msg.response_metadata
        assert (u["node"], u["method"], u["session_id"]) == (node, method, tid)
        assert u["prompt_tokens"] > 0 and u["live_kv_tokens"] > 0
    act = agentkv.usage(act_msg)
    assert act["planned_live_kv_tokens"] <= 16 < act["prompt_tokens"]  # H2O kept its budget
    rows = report.by_node()
    assert set(rows) == {"browse", "act"}
    assert rows["act"]["policies"] == ["h2o(budget=16, recent=4)"]
    assert rows["act"]["prompt_tokens"] == act["prompt_tokens"]
    assert rows["act"]["peak_live_kv_tokens"] == act["live_kv_tokens"]
    # the server has the same per-node breakdown under the thread id the user gave
    summary = session(engine_url, tid)
    assert summary["session_id"] == tid
    assert set(summary["by_node"]) == {"browse", "act"}
    assert summary["by_node"]["act"]["peak_live_kv_tokens"] == act["live_kv_tokens"]
    assert summary["by_node"]["browse"]["prompt_tokens"] == rows["browse"]["prompt_tokens"]


def test_stream_mode_messages_chunk_carries_telemetry(engine_url: str) -> None:
    app = with_kv_policy(two_nodes(chat(engine_url, streaming=True)), default=FullCache())
    chunks = list(
        app.stream(
            ask("Hi."), {"configurable": {"thread_id": "tele-chunks"}}, stream_mode="messages"
        )
    )
    found = [agentkv.usage(m) for m, _ in chunks if agentkv.usage(m) is not None]
    assert [u["node"] for u in found] == ["browse", "act"]


def test_context_manager_and_async(engine_url: str) -> None:
    app = with_kv_policy(two_nodes(chat(engine_url, streaming=True)), default=FullCache())

    async def main() -> dict[str, Any]:
        return await app.ainvoke(ask("Hello."), {"configurable": {"thread_id": "tele-async"}})

    with get_kv_usage_callback() as report:
        out = asyncio.run(main())
    assert set(report.by_node()) == {"browse", "act"}
    assert agentkv.usage(out["messages"][-1])["node"] == "act"


def test_call_time_policy_overrides_wrap_time(engine_url: str) -> None:
    app = with_kv_policy(
        two_nodes(chat(engine_url)), default=FullCache(), nodes={"act": SnapKV(budget=512)}
    )
    out = app.invoke(
        ask("Go."),
        {
            "configurable": {
                "thread_id": "call-time",
                "agentkv": {"nodes": {"act": "h2o:budget=16"}},
            }
        },
    )
    browse, act = (agentkv.usage(m) for m in out["messages"][1:])
    assert browse["method"] == "full" and act["method"] == "h2o"
    bound = app.with_config(configurable={"agentkv": "streamingllm:budget=64"})
    out = bound.invoke(ask("Go."), {"configurable": {"thread_id": "with-config"}})
    browse, act = (agentkv.usage(m) for m in out["messages"][1:])
    assert browse["method"] == "streamingllm" and act["method"] == "snapkv"


def test_context_schema(engine_url: str) -> None:
    @dataclass
    class Context:
        user: str
        agentkv: Any = None

    app = with_kv_policy(two_nodes(chat(engine_url), context_schema=Context), default=FullCache())
    out = app.invoke(
        ask("Go."),
        {"configurable": {"thread_id": "ctx"}},
        context=Context(user="u1", agentkv={"nodes": {"browse": H2O(budget=16)}}),
    )
    browse, act = (agentkv.usage(m) for m in out["messages"][1:])
    assert browse["method"] == "h2o" and act["method"] == "full"


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.mark.parametrize("streaming", [False, True])
def test_create_agent_messages_carry_telemetry(engine_url: str, streaming: bool) -> None:
    agent = create_agent(
        chat(engine_url, streaming=streaming),
        tools=[get_weather],
        system_prompt="You are a travel assistant.",
        middleware=[KVPolicyMiddleware(IntentKV(budget=64), session_id=f"agent-{streaming}")],
    )
    out = agent.invoke(ask("Weather in Paris?"))
    u = agentkv.usage(out["messages"][-1])
    assert u is not None
    assert (u["method"], u["session_id"], u["node"]) == ("intentkv", f"agent-{streaming}", "model")
    assert session(engine_url, f"agent-{streaming}")["by_node"]["model"]["requests"] >= 1


def test_openai_sdk_usage_and_explicit_session(engine_url: str) -> None:
    client = kv_client(
        openai.OpenAI(base_url=engine_url, api_key="x"), "h2o:budget=16", session_id="user-42"
    )
    msgs = [{"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model="m", messages=msgs, max_tokens=3)
    assert agentkv.usage(r)["session_id"] == "user-42"
    chunks = list(
        client.chat.completions.create(model="m", messages=msgs, max_tokens=3, stream=True)
    )
    assert agentkv.usage(chunks[-1])["method"] == "h2o"
    assert session(engine_url, "user-42")["requests"] == 2


def test_unimplemented_method_warns_at_wrap_time(engine_url: str) -> None:
    caps = httpx.get(engine_url + "/agentkv/capabilities", timeout=30).json()
    assert "triaxialkv" not in caps["methods"]
    assert {"full", "intentkv", "h2o", "kvzap", "uniform_quant"} <= set(caps["methods"])
    with pytest.warns(UnimplementedPolicyWarning, match="does not implement 'triaxialkv'"):
        kv_client(openai.OpenAI(base_url=engine_url, api_key="x"), TriAxialKV())
    with pytest.warns(UnimplementedPolicyWarning, match="triaxialkv"):
        with_kv_policy(
            two_nodes(chat(engine_url)), default=FullCache(), nodes={"act": TriAxialKV()}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # implemented methods: silent
        kv_client(openai.OpenAI(base_url=engine_url, api_key="x"), IntentKV(budget=64))
        with_kv_policy(two_nodes(chat(engine_url)), default=H2O(budget=64))
        kv_client(openai.OpenAI(base_url=engine_url, api_key="x"), UniformQuant(bits=4))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_says_so() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # wrapping never fails or warns without a server
        client = kv_client(openai.OpenAI(base_url=url, api_key="x", max_retries=0), KVzap())
        app = with_kv_policy(two_nodes(chat(url)), default=KVzap())
    with pytest.raises(openai.APIConnectionError, match="agentkv serve"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.APIConnectionError, match=f"{url}.*not reachable"):
        app.invoke(ask("hi"))
    agent = create_agent(chat(url), tools=[get_weather], middleware=[KVPolicyMiddleware()])
    with pytest.raises(openai.APIConnectionError, match="start it with `agentkv serve`"):
        agent.invoke(ask("hi"))
