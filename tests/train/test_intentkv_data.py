"""Phase-2 training rows from the real engine: a short tau-bench session replayed under
IntentKV, every compression event recorded and labelled by the next tool calls."""

from __future__ import annotations

import copy

import pytest
import torch

from agentkv import IntentKV
from agentkv.bench.traces import Trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def short_session():
    """tau-bench airline/0/0 cut to a few hundred tokens: the user gives their id (message
    3), answers the agent's questions (5), and the agent calls get_user_details with it (6)."""
    from agentkv.bench.traces import DEFAULT_TAU_BENCH, load_tau_bench

    if not DEFAULT_TAU_BENCH.is_file():
        pytest.skip(f"tau-bench data not found at {DEFAULT_TAU_BENCH}")
    trace = next(t for t in load_tau_bench() if t.id == "tau-bench/airline/0/0")
    m = copy.deepcopy(trace.messages)
    messages = [dict(m[0], content=m[0]["content"][:300]), m[1], m[2], m[3]]
    messages += [dict(m[4], content=m[4]["content"][:200]), m[5], m[6]]
    assert m[6]["tool_calls"][0]["function"]["name"] == "get_user_details"
    tools = [t for t in trace.tools if t["function"]["name"] == "get_user_details"]
    return Trace("tau-bench/airline/0/0-short", "tau-bench", messages, tools)


def test_rows_from_a_replayed_session(engine, short_session):
    from agentkv.train.intentkv_data import argument_values, collect_rows

    rows, stats = collect_rows(
        engine, [short_session], IntentKV(budget=128, protect_system=False), progress=False
    )
    # three requests, each over budget; only the last has the id in its history (at the second
    # the id is the actionable query, forced and never a candidate): one row
    assert (stats.sessions, stats.requests, stats.events) == (1, 3, 3)
    assert stats.rows == len(rows) == 1 and stats.positives == rows[0].positives > 0
    assert rows[0].turn == 6
    user_id = argument_values(short_session.messages[-1]["tool_calls"][0]["function"]["arguments"])
    assert user_id == ["mia_li_3668"]
    for row in rows:
        n = row.labels.numel()
        assert row.rule.shape == (n,) and row.keys.shape == (n, engine.shape.head_dim)
        assert row.memory.shape == (engine.shape.head_dim,) and row.q_keys.shape[0] > 0
        assert float(row.rule.sum()) == pytest.approx(1.0, rel=1e-4)
        torch.testing.assert_close(row.memory_norm, torch.ones_like(row.memory_norm))
        assert 0 < row.positives < n
    assert not engine.methods.for_policy(IntentKV()).recorder  # the hook is removed
