"""Capabilities warnings: asked at wrap time (servers found in the graph's nodes), else before
the first request to a server; silent for servers that cannot say."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from langchain.agents import create_agent
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph

from agentkv import H2O, FullCache, KVzap, UnimplementedPolicyWarning, fetch_capabilities
from agentkv.integrations import openai as kv_openai
from agentkv.integrations.langchain import KVPolicyMiddleware
from agentkv.integrations.langgraph import with_kv_policy
from agentkv.integrations.openai import kv_client
from agentkv.server_capabilities import clear_capabilities_cache

CAPS = {"protocol_version": 1, "methods": ["full", "h2o"], "model": "m"}


@pytest.fixture
def fresh() -> Iterator[None]:
    """No cached answers or checks from other tests (same server URL all session)."""
    clear_capabilities_cache()
    kv_openai._CHECKED.clear()
    yield
    clear_capabilities_cache()
    kv_openai._CHECKED.clear()


def llm(server: Any) -> ChatOpenAI:
    return ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_retries=0)


def test_kv_client_warns_at_wrap_time(server: Any, fresh: None) -> None:
    server.capabilities = CAPS
    base = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.warns(UnimplementedPolicyWarning, match=r"does not implement 'kvzap'.*full, h2o"):
        kv_client(base, KVzap())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv_client(base, H2O(budget=8))


def test_graph_servers_found_in_nodes_warn_at_wrap_time(server: Any, fresh: None) -> None:
    server.capabilities = CAPS
    agent = create_agent(llm(server), tools=[])  # the model sits in a node's closure
    with pytest.warns(UnimplementedPolicyWarning, match="kvzap"):
        with_kv_policy(agent, default=FullCache(), nodes={"model": KVzap()})


def test_first_request_warns_once_when_wrap_time_could_not_tell(server: Any, fresh: None) -> None:
    def node(state: MessagesState) -> dict[str, Any]:  # the model is made in the node
        return {"messages": [llm(server).invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("act", node)
    builder.add_edge(START, "act")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app = with_kv_policy(builder, default=KVzap())  # no server found: nothing to say
    server.capabilities = CAPS
    with pytest.warns(UnimplementedPolicyWarning, match="kvzap") as caught:
        app.invoke({"messages": [("user", "hi")]})
        app.invoke({"messages": [("user", "again")]})
    assert len([w for w in caught if w.category is UnimplementedPolicyWarning]) == 1
    assert len(server.requests) == 2  # the requests still went out (the server decides)


def test_middleware_warns_before_its_first_request(server: Any, fresh: None) -> None:
    server.capabilities = CAPS
    agent = create_agent(llm(server), tools=[], middleware=[KVPolicyMiddleware(KVzap())])
    with pytest.warns(UnimplementedPolicyWarning, match="kvzap"):
        agent.invoke({"messages": [("user", "hi")]})


def test_servers_that_cannot_say_give_no_warning(server: Any, fresh: None) -> None:
    assert fetch_capabilities(server.base_url) is None  # 404: not an agentkv engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv_client(openai.OpenAI(base_url=server.base_url, api_key="x"), KVzap())
        with_kv_policy(create_agent(llm(server), tools=[]), default=KVzap())
