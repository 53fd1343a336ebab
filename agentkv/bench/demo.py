"""The main job (``make demo``): a real LangGraph graph, wrapped with ``with_kv_policy``, on the
embedded engine over HTTP, replaying a real multi-turn tool-use trajectory (tau-bench airline).

The graph has two nodes that call a ``ChatOpenAI`` pointed at the engine: ``respond`` (the
next step after a user message) and ``observe`` (the next step after tool results). Each node
makes a real model call on the conversation so far, then the reference trajectory's own
assistant message and the tool results / user reply that follow are appended, so every
policy sees the same conversation (a 135M model cannot play the airline agent itself).
The table compares per-node KV telemetry of FullCache, IntentKV at several budgets, the
eviction baselines and UniformQuant: peak live KV (the KV attended, counted at full precision)
beside peak resident KV (the bytes the pools hold: quantized cells at their size, evicted
cells freed per (layer, KV head)).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, TypedDict

from agentkv.bench.traces import load_tau_bench
from agentkv.engine.engine import Engine
from agentkv.engine.server import BackgroundServer
from agentkv.engine.telemetry import KVUsage
from agentkv.policies import (
    H2O,
    FullCache,
    IntentKV,
    KVPolicy,
    SnapKV,
    StreamingLLM,
    UniformQuant,
)


class ReplayState(TypedDict):
    cursor: int  # index of the next reference assistant message
    replies: list[str]


def _next_assistant(trajectory: Sequence[dict[str, Any]], start: int) -> int | None:
    return next(
        (i for i in range(start, len(trajectory)) if trajectory[i]["role"] == "assistant"), None
    )


def build_replay_graph(trajectory: Sequence[dict[str, Any]], llm: Any):
    """A ``StateGraph`` stepping through ``trajectory`` (OpenAI messages) with real LLM calls."""
    from langchain_core.messages import convert_to_messages
    from langgraph.graph import END, START, StateGraph

    def step(state: ReplayState) -> dict[str, Any]:
        cursor = state["cursor"]
        reply = llm.invoke(convert_to_messages(list(trajectory[:cursor])))
        nxt = _next_assistant(trajectory, cursor + 1)
        return {
            "cursor": nxt if nxt is not None else len(trajectory),
            "replies": [*state["replies"], reply.content],
        }

    def route(state: ReplayState) -> str:
        cursor = state["cursor"]
        if cursor >= len(trajectory):
            return END
        return "observe" if trajectory[cursor - 1]["role"] == "tool" else "respond"

    graph = StateGraph(ReplayState)
    graph.add_node("respond", step)
    graph.add_node("observe", step)
    routes = {"respond": "respond", "observe": "observe", END: END}
    graph.add_conditional_edges(START, route, routes)
    graph.add_conditional_edges("respond", route, routes)
    graph.add_conditional_edges("observe", route, routes)
    return graph


def demo_policies(budgets: Sequence[int]) -> list[KVPolicy]:
    """FullCache, IntentKV at each budget (and the lowest without the protected system block),
    the eviction baselines at a 1024-token budget, and UniformQuant INT4 / INT2."""
    low = min(budgets) if budgets else 256
    return [
        FullCache(),
        *[IntentKV(budget=b) for b in budgets],
        IntentKV(budget=low, protect_system=False),
        StreamingLLM(budget=1024),
        SnapKV(budget=1024),
        H2O(budget=1024),
        UniformQuant(bits=4),
        UniformQuant(bits=2),
    ]


def _node_rows(usages: Sequence[KVUsage]) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for u in usages:
        for key in (u.node or "-", "ALL"):
            r = rows[key]
            r["calls"] += 1
            r["peak_prompt"] = max(r["peak_prompt"], u.peak_request_tokens)
            r["peak_live"] = max(r["peak_live"], u.live_kv_tokens)
            r["peak_bytes"] = max(r["peak_bytes"], u.live_kv_bytes)
            r["peak_resident"] = max(r["peak_resident"], u.resident_kv_bytes)
            r["prompt"] += u.prompt_tokens
            r["hits"] += u.prefix_hit_tokens
            r["evicted"] += u.evicted_tokens
            r["wall"] += u.wall_time_s
    return rows


def run_demo(
    model: str | None = None,
    device: str | None = None,
    budgets: Sequence[int] = (128, 256),
    trace_index: int = 0,
    max_messages: int = 14,
    max_tokens: int = 16,
    engine: Engine | None = None,
    print_fn: Any = print,
) -> dict[str, dict[str, dict[str, float]]]:
    """Run the demo; returns ``{policy label: {node: metrics}}`` and prints the table."""
    from langchain_openai import ChatOpenAI

    from agentkv.integrations.langgraph import with_kv_policy

    trace = load_tau_bench(limit=None)[trace_index]
    trajectory = list(trace.messages[:max_messages])
    start = _next_assistant(trajectory, 0)
    if start is None:
        raise ValueError("the trajectory has no assistant message")
    t0 = time.perf_counter()
    engine = engine or Engine(model, device=device)
    print_fn(
        f"engine: {engine.model_name} on {engine.device} (loaded in {time.perf_counter() - t0:.1f}s)"
    )
    print_fn(f"trajectory: tau-bench airline #{trace_index}, {len(trajectory)} messages")
    results: dict[str, dict[str, dict[str, float]]] = {}
    with BackgroundServer(engine) as server:
        llm = ChatOpenAI(
            base_url=server.base_url,
            api_key="agentkv",
            model=engine.model_name,
            max_tokens=max_tokens,
            temperature=0,
        )
        graph = build_replay_graph(trajectory, llm)
        for policy in demo_policies(budgets):
            label = policy.describe()
            app = with_kv_policy(graph, default=policy)
            mark = len(engine.request_log)
            app.invoke(
                {"cursor": start, "replies": []},
                config={"configurable": {"thread_id": f"demo-{label}"}, "recursion_limit": 200},
            )
            usages = list(engine.request_log)[mark:]
            results[label] = _node_rows(usages)
            print_fn(f"  ran {label}: {len(usages)} model calls")
    print_fn("")
    print_fn(format_table(results))
    return results


def format_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown table: one row per (policy, node)."""
    full = next((v["ALL"] for k, v in results.items() if k.startswith("full")), None)
    lines = [
        "| policy | node | calls | peak request tokens | peak live KV tokens | peak live KV MiB "
        "| peak resident KV MiB | resident vs full | evicted | prefix-hit rate | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, nodes in results.items():
        for node in sorted(nodes, key=lambda n: (n == "ALL", n)):
            r = nodes[node]
            ratio = (
                f"{r['peak_resident'] / full['peak_resident']:.2f}x"
                if full and node == "ALL" and full["peak_resident"]
                else ""
            )
            lines.append(
                f"| {label} | {node} | {int(r['calls'])} | {int(r['peak_prompt'])} | {r['peak_live']:.0f} "
                f"| {r['peak_bytes'] / 2**20:.1f} | {r['peak_resident'] / 2**20:.1f} | {ratio} | {int(r['evicted'])} "
                f"| {r['hits'] / max(r['prompt'], 1):.2f} | {r['wall']:.1f} |"
            )
    return "\n".join(lines)
