"""The main job's demo: a real LangGraph graph, wrapped with with_kv_policy, on the real
engine over HTTP, replaying a real tau-bench trajectory."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_demo_reports_per_node_kv_telemetry(engine):
    import torch

    from agentkv.bench.demo import run_demo

    lines: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # `agentkv demo --budgets 32 --trace 145 --max-messages 5`: the shortest opening of any
        # tau-bench trajectory that routes through both nodes (respond, then observe after a
        # tool result), so two model calls per policy
        results = run_demo(
            engine=engine,
            budgets=[32],
            trace_index=145,
            max_messages=5,
            max_tokens=2,
            print_fn=lines.append,
        )
    finally:
        torch.set_num_threads(threads)
    labels = list(results)
    assert labels[0] == "full()"
    assert "intentkv(budget=32)" in labels
    assert "intentkv(budget=32, protect_system=False)" in labels
    full = results["full()"]
    # the graph routed calls through both nodes, and every policy made the same calls
    assert {"respond", "observe", "ALL"} <= set(full)
    for nodes in results.values():
        assert nodes["ALL"]["calls"] == full["ALL"]["calls"]
        assert nodes["respond"]["calls"] + nodes["observe"]["calls"] == nodes["ALL"]["calls"]
    assert full["ALL"]["evicted"] == 0
    squeezed = results["intentkv(budget=32, protect_system=False)"]["ALL"]
    assert squeezed["evicted"] > 0
    assert squeezed["peak_live"] < full["ALL"]["peak_live"]
    # memory is resident bytes: quantization shrinks them, per-head eviction frees them
    int4 = results["uniform_quant()"]["ALL"]
    assert int4["peak_live"] >= full["ALL"]["peak_live"] - 1
    assert int4["peak_resident"] < 0.6 * full["ALL"]["peak_resident"]
    assert squeezed["peak_resident"] < full["ALL"]["peak_resident"]
    # later calls of a thread reuse its earlier turns from the prefix cache
    assert full["ALL"]["hits"] > 0
    table = "\n".join(lines)
    for label in labels:
        assert f"| {label} | ALL |" in table
