"""Fixtures of the training tests."""

from __future__ import annotations

import copy

import pytest

from agentkv.bench.traces import Trace


@pytest.fixture(scope="module")
def short_session():
    """tau-bench airline/0/0 cut to a few hundred tokens: the user gives their id (message
    3), answers the agent's questions (5), and the agent calls get_user_details with it (6)."""
    from agentkv.bench.traces import load_tau_bench, tau_bench_path

    try:
        tau_bench_path()  # $AGENTKV_TAU_BENCH, else the shared copy next to the repository
    except FileNotFoundError as e:
        pytest.skip(str(e))
    trace = next(t for t in load_tau_bench() if t.id == "tau-bench/airline/0/0")
    m = copy.deepcopy(trace.messages)
    messages = [dict(m[0], content=m[0]["content"][:300]), m[1], m[2], m[3]]
    messages += [dict(m[4], content=m[4]["content"][:200]), m[5], m[6]]
    assert m[6]["tool_calls"][0]["function"]["name"] == "get_user_details"
    tools = [t for t in trace.tools if t["function"]["name"] == "get_user_details"]
    return Trace("tau-bench/airline/0/0-short", "tau-bench", messages, tools)
