"""with_kv_policy on real LangGraph graphs whose nodes call a real ChatOpenAI."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from typing_extensions import TypedDict

from agentkv import (
    ARKV,
    H2O,
    FullCache,
    GraphPolicy,
    IntentKV,
    KVzap,
    SnapKV,
    TriAxialKV,
    UniformQuant,
    UnknownNodeError,
    resolve_session_id,
)
from agentkv.integrations import openai as kv_openai
from agentkv.integrations.langgraph import (
    CONFIG_KEY,
    KVRunHandler,
    effective_policy,
    graph_node_names,
    policy_for_path,
    with_kv_policy,
)

DEFAULT = IntentKV(budget=8192)
NODES = {"browse": KVzap(threshold=-4), "act": TriAxialKV(avg_bits=2.7)}
EXPECTED = {"browse": NODES["browse"], "act": NODES["act"], "report": DEFAULT}
ORDER = ["browse", "act", "report"]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


# LangGraph hands the current config to async code implicitly only on Python >= 3.11; before
# that, its docs ask async nodes to take `config` and pass it to the model (pass_config=True).
NEEDS_311 = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="implicit config in async nodes needs Python >= 3.11"
)
IMPLICIT_OR_EXPLICIT = [
    pytest.param(False, marks=NEEDS_311, id="implicit"),
    pytest.param(True, id="config"),
]


def _node(llm: ChatOpenAI, system: str, is_async: bool, pass_config: bool = False) -> Any:
    def node(state: State) -> dict[str, Any]:
        return {"messages": [llm.invoke([SystemMessage(system), *state["messages"]])]}

    async def anode(state: State) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([SystemMessage(system), *state["messages"]])]}

    async def anode_config(state: State, config: RunnableConfig) -> dict[str, Any]:
        msgs = [SystemMessage(system), *state["messages"]]
        return {"messages": [await llm.ainvoke(msgs, config)]}

    if is_async:
        return anode_config if pass_config else anode
    return node


def make_builder(llm: ChatOpenAI, is_async: bool = False, pass_config: bool = False) -> StateGraph:
    """browse -> act -> report; ordinary nodes that call ChatOpenAI, nothing agentkv in them."""
    builder = StateGraph(State)
    for name in ORDER:
        builder.add_node(name, _node(llm, f"You are the {name} step.", is_async, pass_config))
    builder.add_edge(START, "browse")
    builder.add_edge("browse", "act")
    builder.add_edge("act", "report")
    builder.add_edge("report", END)
    return builder


@pytest.fixture
def llm(server: Any) -> ChatOpenAI:
    return ChatOpenAI(model="test-model", base_url=server.base_url, api_key="x", max_retries=0)


def user(thread: str, text: str = "find a cheap flight") -> dict[str, Any]:
    return {"messages": [HumanMessage(f"{text} [{thread}]")]}


def thread(tid: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": tid}}


def assert_run(requests: list[Any], check: Any, session_id: str) -> None:
    assert [r.payload.node for r in requests] == ORDER
    for rec in requests:
        node = rec.payload.node
        check(rec, node=node, policy=EXPECTED[node], session_id=session_id)
        assert rec.messages[0] == {"role": "system", "content": f"You are the {node} step."}


def test_invoke(server: Any, llm: ChatOpenAI, check: Any) -> None:
    class Count(BaseCallbackHandler):
        starts = 0

        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            Count.starts += 1

    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES, checkpointer=InMemorySaver())
    out = graph.invoke(user("t-inv"), {**thread("t-inv"), "callbacks": [Count()]})
    assert len(out["messages"]) == 4
    assert Count.starts == 3  # the caller's own callbacks still run
    assert_run(server.requests, check, "t-inv")
    # browse sees [system, user]; act [system, user, ai]; report [system, user, ai, ai]
    assert [len(r.messages) for r in server.requests] == [2, 3, 4]
    # still a compiled graph: state API works, and no agentkv data in the state
    state = graph.get_state(thread("t-inv"))
    assert set(state.values) == {"messages"}
    assert "agentkv" not in repr(state.values)


def test_stream_messages_mode(server: Any, llm: ChatOpenAI, check: Any) -> None:
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES, checkpointer=InMemorySaver())
    chunks = list(graph.stream(user("t-st"), thread("t-st"), stream_mode="messages"))
    assert {meta["langgraph_node"] for _, meta in chunks} == set(ORDER)
    assert all(r.body["stream"] is True for r in server.requests)  # token streaming path
    assert_run(server.requests, check, "t-st")


@pytest.mark.parametrize("pass_config", IMPLICIT_OR_EXPLICIT)
@pytest.mark.parametrize("mode", ["updates", "messages"])
def test_ainvoke_astream(
    server: Any, llm: ChatOpenAI, check: Any, mode: str, pass_config: bool
) -> None:
    graph = with_kv_policy(make_builder(llm, True, pass_config), DEFAULT, NODES)

    async def main() -> None:
        await graph.ainvoke(user("t-ai"), thread("t-ai"))
        assert_run(server.requests, check, "t-ai")
        server.clear()
        chunks = [c async for c in graph.astream(user("t-as"), thread("t-as"), stream_mode=mode)]
        assert chunks
        assert_run(server.requests, check, "t-as")
        assert all(bool(r.body.get("stream")) is (mode == "messages") for r in server.requests)

    asyncio.run(main())


@NEEDS_311
def test_sync_nodes_under_ainvoke(server: Any, llm: ChatOpenAI, check: Any) -> None:
    """Sync nodes run in LangGraph's executor threads under ainvoke: context still flows."""
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES)
    asyncio.run(graph.ainvoke(user("t-mix"), thread("t-mix")))
    assert_run(server.requests, check, "t-mix")


def test_subgraphs(server: Any, llm: ChatOpenAI, check: Any) -> None:
    inner = StateGraph(State)
    inner.add_node("search", _node(llm, "search", False))
    inner.add_node("summarize", _node(llm, "summarize", False))
    inner.add_edge(START, "search")
    inner.add_edge("search", "summarize")
    research = inner.compile()

    side = StateGraph(State)
    side.add_node("lookup", _node(llm, "lookup", False))
    side.add_edge(START, "lookup")
    lookup_graph = side.compile()

    def delegate(state: State) -> dict[str, Any]:  # a subgraph called from a node's code
        return {"messages": lookup_graph.invoke(state)["messages"][len(state["messages"]) :]}

    outer = StateGraph(State)
    outer.add_node("plan", _node(llm, "plan", False))
    outer.add_node("research", research)  # a subgraph as a node
    outer.add_node("delegate", delegate)
    outer.add_edge(START, "plan")
    outer.add_edge("plan", "research")
    outer.add_edge("research", "delegate")
    outer.add_edge("delegate", END)

    nodes = {
        "search": KVzap(threshold=-4),
        "research": TriAxialKV(avg_bits=2.7),
        "lookup": ARKV(budget=256),
    }
    graph = with_kv_policy(outer, DEFAULT, nodes, checkpointer=InMemorySaver())
    graph.invoke(user("t-sub"), thread("t-sub"))

    got = {r.payload.node: r for r in server.requests}
    assert list(got) == ["plan", "search", "summarize", "lookup"]
    check(got["plan"], node="plan", policy=DEFAULT, session_id="t-sub")
    # innermost node's own policy
    check(got["search"], node="search", policy=nodes["search"], session_id="t-sub/research")
    # no override for summarize: the enclosing subgraph node's policy
    check(got["summarize"], node="summarize", policy=nodes["research"], session_id="t-sub/research")
    check(got["lookup"], node="lookup", policy=nodes["lookup"], session_id="t-sub/delegate")

    # nested names and paths are valid keys; a path key beats the bare enclosing name
    names = graph_node_names(outer.compile())
    assert {"plan", "research", "search", "summarize", "research/summarize", "lookup"} <= names
    server.clear()
    by_path = {**nodes, "research/summarize": UniformQuant(bits=2)}
    with_kv_policy(outer, DEFAULT, by_path).invoke(user("t-path"), thread("t-path"))
    got = {r.payload.node: r for r in server.requests}
    check(
        got["summarize"],
        node="summarize",
        policy=UniformQuant(bits=2),
        session_id="t-path/research",
    )


def test_model_call_in_plain_thread(server: Any, llm: ChatOpenAI, check: Any) -> None:
    """A node hands its model call to a plain thread (no context copied) but passes `config`:
    the callback path still finds node, thread and policy. A raw SDK call in such a thread,
    with nothing to tie it to the run, is left alone."""
    import openai

    raw = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)

    def browse(state: State, config: RunnableConfig) -> dict[str, Any]:
        out: dict[str, Any] = {}

        def work() -> None:
            out["reply"] = llm.invoke(
                [SystemMessage("You are the browse step."), *state["messages"]], config
            )
            raw.chat.completions.create(model="m", messages=[{"role": "user", "content": "raw"}])

        t = threading.Thread(target=work)
        t.start()
        t.join()
        return {"messages": [out["reply"]]}

    builder = StateGraph(State)
    builder.add_node("browse", browse)
    builder.add_edge(START, "browse")
    graph = with_kv_policy(
        builder, DEFAULT, {"browse": NODES["browse"]}, checkpointer=InMemorySaver()
    )
    graph.invoke(user("t-plain-thread"), thread("t-plain-thread"))
    model_call, raw_call = server.requests
    check(model_call, node="browse", policy=NODES["browse"], session_id="t-plain-thread")
    assert "custom_params" not in raw_call.body


def test_raw_sdk_call_inside_node(server: Any, check: Any) -> None:
    """An OpenAI SDK call made directly in a node's code (no LangChain model) is claimed too."""
    import openai

    raw = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)

    def act(state: State) -> dict[str, Any]:
        raw.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}])
        return {}

    builder = StateGraph(State)
    builder.add_node("act", act)
    builder.add_edge(START, "act")
    graph = with_kv_policy(builder, DEFAULT, {"act": NODES["act"]}, checkpointer=InMemorySaver())
    graph.invoke(user("t-raw"), thread("t-raw"))
    check(server.requests[0], node="act", policy=NODES["act"], session_id="t-raw")


def test_policy_for_path() -> None:
    gp = GraphPolicy(default=DEFAULT, nodes={"a": KVzap(), "a/b": ARKV(), "c": UniformQuant()})
    assert policy_for_path(gp, ("a", "b")) == ARKV()
    assert policy_for_path(gp, ("a", "x")) == KVzap()
    assert policy_for_path(gp, ("x", "c")) == UniformQuant()
    assert policy_for_path(gp, ("x", "y")) == DEFAULT
    assert policy_for_path(gp, (), node="c") == UniformQuant()


def _marker(rec: Any) -> str:
    return re.search(r"\[([\w-]+)\]", rec.text()).group(1)


def _assert_isolated(requests: list[Any], check: Any, tids: list[str]) -> None:
    assert len(requests) == 3 * len(tids)
    for tid in tids:
        mine = [r for r in requests if _marker(r) == tid]
        assert_run(mine, check, f"{tid}")
    # the runs really overlapped in time
    spans = {tid: [(r.start, r.end) for r in requests if _marker(r) == tid] for tid in tids}
    a, b = spans[tids[0]], spans[tids[1]]
    assert any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


def test_concurrent_threads_never_mix(server: Any, llm: ChatOpenAI, check: Any) -> None:
    graph = with_kv_policy(make_builder(llm).compile(checkpointer=InMemorySaver()), DEFAULT, NODES)
    server.delay = 0.05
    tids = ["alpha", "beta", "gamma", "delta"]
    with ThreadPoolExecutor(len(tids)) as pool:
        list(pool.map(lambda t: graph.invoke(user(t), thread(t)), tids))
    _assert_isolated(server.requests, check, tids)


@pytest.mark.parametrize("pass_config", IMPLICIT_OR_EXPLICIT)
def test_concurrent_ainvoke_never_mix(
    server: Any, llm: ChatOpenAI, check: Any, pass_config: bool
) -> None:
    graph = with_kv_policy(make_builder(llm, True, pass_config), DEFAULT, NODES)
    server.delay = 0.05
    tids = ["one", "two", "three"]

    async def main() -> None:
        await asyncio.gather(*(graph.ainvoke(user(t), thread(t)) for t in tids))

    asyncio.run(main())
    _assert_isolated(server.requests, check, tids)


def test_same_thread_keeps_session(server: Any, llm: ChatOpenAI, check: Any) -> None:
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES, checkpointer=InMemorySaver())
    graph.invoke(user("t-keep", "first task"), thread("t-keep"))
    graph.invoke(user("t-keep", "second task"), thread("t-keep"))
    graph.invoke(user("t-else"), thread("t-else"))
    first, second, other = server.requests[:3], server.requests[3:6], server.requests[6:]
    assert_run(first, check, "t-keep")
    assert_run(second, check, "t-keep")
    assert_run(other, check, "t-else")
    # the second turn carries the history: the new user message opens turn 1, actionable
    browse = second[0].payload.messages
    assert [a.role for a in browse] == [
        "system",
        "user",
        "assistant",
        "assistant",
        "assistant",
        "user",
    ]
    assert [a.turn for a in browse] == [0, 0, 0, 0, 0, 1]
    assert [a.actionable for a in browse] == [False] * 5 + [True]


def test_no_thread_id_session_from_messages(server: Any, llm: ChatOpenAI, check: Any) -> None:
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES)  # no checkpointer, no thread
    graph.invoke(user("t-none"))
    for rec in server.requests:
        sid = resolve_session_id(messages=rec.messages)
        assert sid.startswith("task:")
        check(rec, node=rec.payload.node, policy=EXPECTED[rec.payload.node], session_id=sid)


def test_user_extra_body_is_merged(server: Any, check: Any) -> None:
    llm = ChatOpenAI(
        model="test-model",
        base_url=server.base_url,
        api_key="x",
        extra_body={"top_k": 5, "custom_params": {"tenant": "acme"}},
    )
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES)
    graph.invoke(user("t-merge"), thread("t-merge"))
    assert_run(server.requests, check, "t-merge")
    for rec in server.requests:
        assert rec.body["top_k"] == 5
        assert rec.body["custom_params"]["tenant"] == "acme"


def test_unknown_nodes_raise_at_wrap_time(llm: ChatOpenAI) -> None:
    builder = make_builder(llm)
    with pytest.raises(UnknownNodeError, match="brwose"):
        with_kv_policy(builder, DEFAULT, {"brwose": KVzap()})
    with pytest.raises(UnknownNodeError, match="nope"):
        with_kv_policy(builder.compile(), DEFAULT, {"act": KVzap(), "nope": KVzap()})
    with pytest.raises(TypeError):
        with_kv_policy(builder.compile(), DEFAULT, NODES, checkpointer=InMemorySaver())


def test_policies_as_specs_and_dicts(server: Any, llm: ChatOpenAI, check: Any) -> None:
    graph = with_kv_policy(
        make_builder(llm),
        "intentkv:budget=8192",
        {"browse": {"method": "kvzap", "threshold": -4}, "act": TriAxialKV(avg_bits=2.7)},
    )
    graph.invoke(user("t-spec"), thread("t-spec"))
    assert_run(server.requests, check, "t-spec")


def test_plain_graph_sends_nothing(server: Any, llm: ChatOpenAI) -> None:
    with_kv_policy(make_builder(llm), DEFAULT, NODES)  # instrumentation installed
    assert kv_openai.is_instrumented()
    make_builder(llm).compile().invoke(user("t-plain"), thread("t-plain"))
    llm.invoke("hello outside any graph")
    assert len(server.requests) == 4
    assert all("custom_params" not in r.body for r in server.requests)


@pytest.mark.parametrize("restore", [False, True])
def test_uninstrument(server: Any, llm: ChatOpenAI, check: Any, restore: bool) -> None:
    from openai.resources.chat.completions import Completions

    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES)
    graph.invoke(user("t-warm"), thread("t-warm"))  # clients cache their raw-response helpers
    server.clear()
    try:
        kv_openai.uninstrument(restore=restore)
        assert not kv_openai.is_instrumented()
        assert hasattr(Completions.create, "__agentkv_original__") is not restore
        graph.invoke(user("t-off"), thread("t-off"))
        assert len(server.requests) == 3
        assert all("custom_params" not in r.body for r in server.requests)
    finally:
        kv_openai.instrument()
    server.clear()
    graph.invoke(user("t-on"), thread("t-on"))
    assert_run(server.requests, check, "t-on")


# ------------------------------------------------------------ call-time config and re-wraps


def test_call_time_configurable_merges_over_wrap_time(
    server: Any, llm: ChatOpenAI, check: Any
) -> None:
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES, checkpointer=InMemorySaver())
    over = {"nodes": {"act": "h2o:budget=32"}}
    graph.invoke(user("t-call"), {"configurable": {"thread_id": "t-call", CONFIG_KEY: over}})
    got = {r.payload.node: r.payload.policy for r in server.requests}
    assert got == {"browse": NODES["browse"], "act": H2O(budget=32), "report": DEFAULT}
    server.clear()
    # a single policy (object or spec string) replaces the default only
    bound = graph.with_config(configurable={CONFIG_KEY: "snapkv:budget=64"})
    bound.invoke(user("t-wc"), thread("t-wc"))
    got = {r.payload.node: r.payload.policy for r in server.requests}
    assert got == {"browse": NODES["browse"], "act": NODES["act"], "report": SnapKV(budget=64)}
    server.clear()
    graph.invoke(user("t-after"), thread("t-after"))  # the wrapped graph is unchanged
    assert_run(server.requests, check, "t-after")


def test_misspelled_node_at_call_time_raises(llm: ChatOpenAI) -> None:
    graph = with_kv_policy(make_builder(llm), DEFAULT, NODES)
    cfg = {"configurable": {CONFIG_KEY: {"nodes": {"brwose": "full"}}}}
    with pytest.raises(UnknownNodeError, match=r"'brwose' \(did you mean 'browse'\?\)"):
        graph.invoke(user("t-typo"), cfg)
    with pytest.raises(UnknownNodeError, match="did you mean 'report'"):
        with_kv_policy(make_builder(llm), DEFAULT, {"reprot": KVzap()})


def test_second_wrap_merges(server: Any, llm: ChatOpenAI, check: Any) -> None:
    inner = with_kv_policy(make_builder(llm), DEFAULT, {"browse": NODES["browse"]})
    outer = with_kv_policy(inner, nodes={"act": NODES["act"]})  # default kept
    handlers = [c for c in outer.config["callbacks"] if isinstance(c, KVRunHandler)]
    assert len(handlers) == 1
    assert handlers[0].policy == GraphPolicy(default=DEFAULT, nodes=NODES)
    outer.invoke(user("t-twice"), thread("t-twice"))
    assert_run(server.requests, check, "t-twice")
    server.clear()
    with_kv_policy(outer, "full").invoke(user("t-thrice"), thread("t-thrice"))
    got = {r.payload.node: r.payload.policy for r in server.requests}
    assert got == {"browse": NODES["browse"], "act": NODES["act"], "report": FullCache()}


def test_compiled_graph_with_compile_kwargs_says_what_to_do(llm: ChatOpenAI) -> None:
    with pytest.raises(TypeError, match=r"Pass the StateGraph builder.*checkpointer"):
        with_kv_policy(make_builder(llm).compile(), DEFAULT, checkpointer=InMemorySaver())


def test_effective_policy() -> None:
    base = GraphPolicy(default=DEFAULT, nodes=NODES)
    assert effective_policy(base, None) is base
    assert effective_policy(base, {"configurable": {CONFIG_KEY: base}}) is base
    cfg = {"configurable": {CONFIG_KEY: {"default": "full", "nodes": {"act": IntentKV(64)}}}}
    got = effective_policy(base, cfg)
    assert got.default == FullCache()
    assert dict(got.nodes) == {"browse": NODES["browse"], "act": IntentKV(budget=64)}
    assert effective_policy(None, {"configurable": {}}) is None
