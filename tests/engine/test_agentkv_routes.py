"""agentkv's own server routes: capabilities, the per-node session breakdown, request logs."""

from __future__ import annotations

import logging

import pytest

from agentkv import H2O, FullCache, build_payload, to_extra_body
from agentkv.methods import registered_methods
from agentkv.server_capabilities import ServerCapabilities

pytestmark = pytest.mark.slow


def test_capabilities_lists_the_implemented_methods(http, engine):
    r = http.get("/v1/agentkv/capabilities")
    assert r.status_code == 200
    body = r.json()
    assert body["protocol_version"] == 1
    assert body["methods"] == sorted(registered_methods())
    assert {"full", "intentkv", "snapkv", "h2o", "streamingllm"} <= set(body["methods"])
    assert body["model"] == engine.model_name
    # how it decodes (the test engine: the CPU's dense path, no CUDA graphs)
    assert body["decode"] == {
        "attention": engine.decode_attention,
        "cuda_graphs": False,
        "graph_failure": None,
        "steps_ahead": False,
        "fused_ops": [],  # (transformers' own ops on the CPU)
    }
    caps = ServerCapabilities.model_validate(body)  # (as the clients read it)
    assert caps.decode is not None and caps.decode.attention == engine.decode_attention
    assert not caps.decode.cuda_graphs and caps.decode.fused_ops == []


def test_session_breakdown_per_node_and_request_log(client, http, sid, caplog):
    msgs = [{"role": "system", "content": f"{sid}: be brief."}, {"role": "user", "content": "Hi"}]
    calls = [("plan", FullCache()), ("act", H2O(budget=8, recent=2)), ("act", FullCache())]
    with caplog.at_level(logging.INFO, logger="agentkv.server"):
        for node, policy in calls:
            payload = build_payload(msgs, policy, sid, node=node)
            client.chat.completions.create(
                model="m", messages=msgs, max_tokens=2, extra_body=to_extra_body(payload)
            )
    summary = http.get(f"/v1/agentkv/sessions/{sid}").json()
    by_node = summary["by_node"]
    assert set(by_node) == {"plan", "act"}
    assert by_node["plan"]["requests"] == 1 and by_node["act"]["requests"] == 2
    assert by_node["act"]["policies"] == ["h2o(budget=8, recent=2)", "full()"]
    assert sum(n["prompt_tokens"] for n in by_node.values()) == summary["prompt_tokens"]
    assert sum(n["prefix_hit_tokens"] for n in by_node.values()) == summary["prefix_hit_tokens"]
    lines = [r.getMessage() for r in caplog.records if f"session={sid}" in r.getMessage()]
    assert len(lines) == 3
    assert "node=act policy=h2o(budget=8, recent=2)" in lines[1]
    assert all("prefix_hits=" in line and "live_kv=" in line and "wall=" in line for line in lines)
