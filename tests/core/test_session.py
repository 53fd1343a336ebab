"""Session ids: explicit > LangGraph thread + node path > task hash > request-local."""

from __future__ import annotations

import pytest

from agentkv.session import (
    check_session_id,
    checkpoint_node_path,
    is_request_local,
    resolve_session_id,
    task_hash,
)

# checkpoint_ns values as LangGraph 1.x sets them inside nodes (recorded from a real graph:
# a root node, and a node inside a subgraph that runs as node "tools")
NS_AGENT_STEP1 = "agent:89589109-d3cb-3c50-c65b-abb664ebbf1a"
NS_AGENT_STEP2 = "agent:895eb195-e375-cbfc-a53f-712623c3b40a"
NS_INNER_STEP1 = (
    "tools:2b4aa550-9d24-4369-f9a0-94b8b81b136a|inner:ff6ff874-63ae-0567-39b2-6b2ebd287ca3"
)
NS_INNER_STEP2 = (
    "tools:b248fece-1543-3f5c-7237-b542717a1bdf|inner:c1c80808-96d8-7952-4957-cfb58b8b65a5"
)


def test_checkpoint_node_path_strips_task_ids():
    assert checkpoint_node_path(NS_AGENT_STEP1) == "agent"
    assert checkpoint_node_path(NS_INNER_STEP1) == "tools/inner"
    assert checkpoint_node_path("") == ""
    assert checkpoint_node_path(None) == ""
    assert checkpoint_node_path("plain") == "plain"
    assert checkpoint_node_path("a:1||b:2") == "a/b"


def test_priority_order(tau_trajs):
    msgs = tau_trajs[0]
    assert (
        resolve_session_id("mine", thread_id="t", checkpoint_ns=NS_AGENT_STEP1, messages=msgs)
        == "mine"
    )
    assert (
        resolve_session_id(None, thread_id="t", checkpoint_ns=NS_AGENT_STEP1, messages=msgs)
        == "t/agent"
    )
    assert resolve_session_id(thread_id="t", messages=msgs) == "t"
    assert resolve_session_id(messages=msgs) == f"task:{task_hash(msgs)}"
    assert resolve_session_id().startswith("req:")
    # empty strings do not count as given
    assert resolve_session_id("", thread_id="", messages=msgs).startswith("task:")


def test_thread_ids_are_stable_across_steps_and_distinct_per_node_and_thread():
    a1 = resolve_session_id(thread_id="t1", checkpoint_ns=NS_AGENT_STEP1)
    a2 = resolve_session_id(thread_id="t1", checkpoint_ns=NS_AGENT_STEP2)
    i1 = resolve_session_id(thread_id="t1", checkpoint_ns=NS_INNER_STEP1)
    i2 = resolve_session_id(thread_id="t1", checkpoint_ns=NS_INNER_STEP2)
    assert a1 == a2 == "t1/agent"
    assert i1 == i2 == "t1/tools/inner"
    assert resolve_session_id(thread_id="t2", checkpoint_ns=NS_AGENT_STEP1) != a1


def test_given_ids_are_used_as_given_and_never_collide_with_derived_ones():
    """The id the user gave is the id the server sees; derived ids carry a prefix that a
    given id may not start with, so a thread id that looks like a task hash never collides
    with the task-hash id."""
    msgs = [{"role": "user", "content": "hi"}]
    h = task_hash(msgs)
    assert resolve_session_id("user-42") == "user-42"
    assert resolve_session_id(thread_id=h) == h != resolve_session_id(messages=msgs)
    assert resolve_session_id(h) != resolve_session_id(messages=msgs)
    assert resolve_session_id("t") == resolve_session_id(thread_id="t")  # one name, one session
    for bad in ("task:abc", "req:abc"):
        with pytest.raises(ValueError, match="prefix agentkv keeps"):
            resolve_session_id(bad)
        with pytest.raises(ValueError, match="thread_id"):
            resolve_session_id(thread_id=bad)
    with pytest.raises(ValueError, match="at most 512"):
        check_session_id("x" * 513)


def test_task_hash_stable_as_the_conversation_grows(tau_trajs):
    for traj in tau_trajs[::10]:
        first_user = next(i for i, m in enumerate(traj) if m["role"] == "user")
        full = resolve_session_id(messages=traj)
        assert full.startswith("task:")
        for end in range(first_user + 1, len(traj) + 1):
            assert resolve_session_id(messages=traj[:end]) == full
        # before the first user message there is nothing to anchor on
        assert task_hash(traj[:first_user]) is None


def test_task_hash_separates_tasks(tau_items):
    """Different openings (system prompt + first user message) give different ids; equal
    openings give equal ids. tau-bench's simulated users sometimes open two different tasks
    with the same sentence, which is the limit of this fallback."""
    by_hash: dict[str, set] = {}
    for item in tau_items:
        traj = item["traj"]
        opening = (traj[0]["content"], next(m["content"] for m in traj if m["role"] == "user"))
        by_hash.setdefault(task_hash(traj), set()).add(opening)
    assert all(len(openings) == 1 for openings in by_hash.values())
    assert len(by_hash) > 150


def test_task_hash_depends_on_system_prompt_and_first_user_only():
    base = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    h = task_hash(base)
    assert (
        task_hash(base + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}])
        == h
    )
    assert task_hash([{"role": "system", "content": "S2"}, base[1]]) != h
    assert task_hash([base[0], {"role": "user", "content": "U2"}]) != h
    assert task_hash([base[1]]) != h
    assert task_hash([{"role": "developer", "content": "S"}, base[1]]) == h
    # content blocks hash by value
    blocks = [{"role": "user", "content": [{"type": "text", "text": "U"}]}]
    assert task_hash(blocks) == task_hash(blocks) != task_hash([base[1]])


def test_task_hash_differs_between_bfcl_examples(bfcl_base):
    hashes = {}
    for t in bfcl_base:
        first = next(m["content"] for m in t.messages if m["role"] == "user")
        hashes.setdefault(task_hash(t.messages), set()).add(first)
    assert all(len(v) == 1 for v in hashes.values())
    assert len(hashes) >= 190


def test_request_local_ids_never_repeat():
    no_user = [{"role": "system", "content": "S"}]
    ids = {resolve_session_id(messages=no_user) for _ in range(2000)} | {
        resolve_session_id() for _ in range(2000)
    }
    assert len(ids) == 4000
    assert all(is_request_local(i) for i in ids)
    assert not is_request_local(resolve_session_id("x"))
    assert not is_request_local(resolve_session_id(thread_id="t"))
    assert not is_request_local(resolve_session_id(messages=[{"role": "user", "content": "u"}]))


def test_langchain_messages_hash_like_dicts(tau_trajs):
    lc = pytest.importorskip("langchain_core.messages")
    for traj in tau_trajs[:10]:
        assert task_hash(lc.convert_to_messages(traj)) == task_hash(traj)


def test_live_langgraph_thread_ids():
    """Real LangGraph: ids from each node's config stay put across invocations of a thread."""
    pytest.importorskip("langgraph")
    from typing import TypedDict

    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.config import get_config
    from langgraph.graph import END, START, StateGraph

    seen: list[tuple[str, str]] = []

    class S(TypedDict):
        x: int

    def record(node):
        def fn(state):
            conf = get_config()["configurable"]
            sid = resolve_session_id(
                thread_id=conf["thread_id"], checkpoint_ns=conf.get("checkpoint_ns")
            )
            seen.append((node, sid))
            return {"x": state["x"] + 1}

        return fn

    sub = StateGraph(S)
    sub.add_node("inner", record("inner"))
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    g = StateGraph(S)
    g.add_node("agent", record("agent"))
    g.add_node("tools", sub.compile())
    g.add_edge(START, "agent")
    g.add_edge("agent", "tools")
    g.add_edge("tools", END)
    app = g.compile(checkpointer=InMemorySaver())
    for thread in ("t1", "t1", "t2"):
        app.invoke({"x": 0}, {"configurable": {"thread_id": thread}})
    assert seen == [
        ("agent", "t1/agent"),
        ("inner", "t1/tools/inner"),
        ("agent", "t1/agent"),
        ("inner", "t1/tools/inner"),
        ("agent", "t2/agent"),
        ("inner", "t2/tools/inner"),
    ]
