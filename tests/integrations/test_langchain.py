"""KVPolicyMiddleware on a real create_agent agent with a tool, against the recording server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from agentkv import FullCache, IntentKV, Role, resolve_session_id
from agentkv.integrations.langchain import KVPolicyMiddleware

POLICY = IntentKV(budget=512)
SYSTEM = "You are a travel assistant."


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def make_agent(server: Any, middleware: KVPolicyMiddleware | None = None, **llm_kwargs: Any) -> Any:
    llm = ChatOpenAI(
        model="test-model", base_url=server.base_url, api_key="x", max_retries=0, **llm_kwargs
    )
    return create_agent(
        llm,
        tools=[get_weather],
        system_prompt=SYSTEM,
        middleware=[middleware or KVPolicyMiddleware(POLICY)],
        checkpointer=InMemorySaver(),
    )


def ask(tid: str) -> dict[str, Any]:
    return {"messages": [HumanMessage(f"weather in Paris? [{tid}]")]}


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


def assert_agent_run(
    requests: list[Any], check: Any, session_id: str, policy: Any = POLICY
) -> None:
    """Two model calls: the first asks for the tool, the second sees the tool result."""
    assert len(requests) == 2
    first, second = requests
    check(first, node="model", policy=policy, session_id=session_id)
    assert [m["role"] for m in first.messages] == ["system", "user"]
    assert first.messages[0]["content"] == SYSTEM
    payload = check(second, node="model", policy=policy, session_id=session_id)
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "tool"]
    tool_ann = payload.messages[3]
    assert tool_ann.role == "tool" and tool_ann.actionable and tool_ann.semantic is Role.OBS
    assert payload.messages[2].num_tool_calls == 1
    assert not payload.messages[1].actionable


def test_invoke_with_tool_call(server: Any, check: Any) -> None:
    agent = make_agent(server)
    out = agent.invoke(ask("a-inv"), thread("a-inv"))
    assert isinstance(out["messages"][2], ToolMessage)
    assert out["messages"][-1].content == "reply 2"
    assert_agent_run(server.requests, check, "a-inv")
    # nothing agentkv in the graph state
    state = agent.get_state(thread("a-inv")).values
    assert "agentkv" not in repr(state)


def test_stream(server: Any, check: Any) -> None:
    agent = make_agent(server)
    chunks = list(agent.stream(ask("a-st"), thread("a-st"), stream_mode="messages"))
    assert chunks
    assert all(r.body["stream"] is True for r in server.requests)
    assert_agent_run(server.requests, check, "a-st")


@pytest.mark.parametrize("mode", ["updates", "messages"])
def test_ainvoke_astream(server: Any, check: Any, mode: str) -> None:
    agent = make_agent(server)

    async def main() -> None:
        await agent.ainvoke(ask("a-ai"), thread("a-ai"))
        assert_agent_run(server.requests, check, "a-ai")
        server.clear()
        chunks = [c async for c in agent.astream(ask("a-as"), thread("a-as"), stream_mode=mode)]
        assert chunks
        assert_agent_run(server.requests, check, "a-as")

    asyncio.run(main())


def test_concurrent_threads_never_mix(server: Any, check: Any) -> None:
    agent = make_agent(server)
    server.delay = 0.05
    tids = ["a-one", "a-two", "a-three"]

    async def main() -> None:
        await asyncio.gather(*(agent.ainvoke(ask(t), thread(t)) for t in tids))

    asyncio.run(main())
    for tid in tids:
        mine = [r for r in server.requests if f"[{tid}]" in r.text()]
        assert_agent_run(mine, check, f"{tid}")


def test_same_thread_keeps_session(server: Any, check: Any) -> None:
    agent = make_agent(server)
    agent.invoke(ask("a-keep"), thread("a-keep"))
    agent.invoke({"messages": [HumanMessage("and tomorrow?")]}, thread("a-keep"))
    assert len(server.requests) == 4  # each turn: tool call, then the answer
    assert_agent_run(server.requests[:2], check, "a-keep")
    for rec in server.requests[2:]:
        check(rec, node="model", policy=POLICY, session_id="a-keep")
    turn2 = server.requests[2].payload.messages
    assert [a.role for a in turn2] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert [a.turn for a in turn2] == [0, 0, 0, 0, 0, 1]
    assert [a.actionable for a in turn2] == [False] * 5 + [True]


def test_session_from_messages_without_thread(server: Any, check: Any) -> None:
    llm = ChatOpenAI(model="test-model", base_url=server.base_url, api_key="x", max_retries=0)
    agent = create_agent(
        llm, tools=[get_weather], system_prompt=SYSTEM, middleware=[KVPolicyMiddleware(POLICY)]
    )
    agent.invoke(ask("a-none"))
    sid = resolve_session_id(messages=server.requests[0].messages)
    assert sid.startswith("task:")
    assert_agent_run(server.requests, check, sid)


def test_explicit_session_node_and_spec(server: Any, check: Any) -> None:
    mw = KVPolicyMiddleware("full", session_id="s-42", node="planner")
    agent = make_agent(server, mw)
    agent.invoke(ask("a-x"), thread("a-x"))
    for rec in server.requests:
        check(rec, node="planner", policy=FullCache(), session_id="s-42")


def test_user_extra_body_is_merged(server: Any, check: Any) -> None:
    agent = make_agent(server, extra_body={"top_k": 3, "custom_params": {"tenant": "acme"}})
    agent.invoke(ask("a-merge"), thread("a-merge"))
    assert_agent_run(server.requests, check, "a-merge")
    for rec in server.requests:
        assert rec.body["top_k"] == 3
        assert rec.body["custom_params"]["tenant"] == "acme"


def test_without_middleware_sends_nothing(server: Any) -> None:
    llm = ChatOpenAI(model="test-model", base_url=server.base_url, api_key="x", max_retries=0)
    create_agent(llm, tools=[get_weather], system_prompt=SYSTEM).invoke(ask("a-plain"))
    assert len(server.requests) == 2
    assert all("custom_params" not in r.body for r in server.requests)
