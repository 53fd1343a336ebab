"""Eight multi-turn sessions at once through the HTTP server (AsyncOpenAI), FullCache and
IntentKV mixed: no crossed session ids, prefix hits on later turns, one QueryMemory per
IntentKV session fed only by its own requests, a consistent store, and no leaked slot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from agentkv import build_payload, to_extra_body
from agentkv.engine.engine import GenerationConfig
from agentkv.policies import FullCache, IntentKV
from agentkv.session import scope_session_id
from agentkv.wire import KVPayload

pytestmark = pytest.mark.slow

SESSIONS = 8
TURNS = 3
MAX_TOKENS = 2
TOPICS = ["cats", "rivers", "trains", "apples", "stars", "bread", "music", "snow"]
FOLLOW_UPS = ["Why?", "Say more."]


def policy_of(i: int):
    return IntentKV(budget=6) if i % 2 else FullCache()


async def run_session(client: Any, i: int, tag: str) -> dict[str, Any]:
    sid = f"{tag}-s{i}"
    policy = policy_of(i)
    messages = [
        {"role": "system", "content": f"Session {i} ({tag}). Be brief."},
        {"role": "user", "content": f"Tell me one fact about {TOPICS[i]}."},
    ]
    turns = []
    for turn in range(TURNS):
        sent = [dict(m) for m in messages]
        payload = build_payload(sent, policy, session_id=sid, node=f"node{i}")
        resp = await client.chat.completions.create(
            model="m", messages=sent, max_tokens=MAX_TOKENS, extra_body=to_extra_body(payload)
        )
        ak = resp.usage.model_dump()["agentkv"]
        turns.append({"messages": sent, "usage": ak, "content": resp.choices[0].message.content})
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
        ]
    return {"sid": sid, "policy": policy, "turns": turns}


async def run_all(base_url: str, tag: str) -> list[dict[str, Any]]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300) as c:
        return await asyncio.gather(*(run_session(c, i, tag) for i in range(SESSIONS)))


def test_concurrent_sessions(server, engine, sid):
    pytest.importorskip("openai")
    tag = sid.split("-")[0]
    memory = engine.methods.for_policy(IntentKV()).memory
    before = set(memory._store)
    logged = len(engine.request_log)
    sessions = asyncio.run(run_all(server.base_url, tag))
    # the server keeps sessions in the caller's namespace (anonymous tenant, no cache salt)
    ns = server.config.app.state.tenancy.namespace("")

    def key(session_id: str) -> str:
        return scope_session_id(ns, session_id)

    order = [u.session_id for u in list(engine.request_log)[logged:]]
    assert len(order) == SESSIONS * TURNS
    assert len(set(order[:SESSIONS])) >= SESSIONS // 2, order  # the sessions interleaved

    for i, s in enumerate(sessions):
        for k, t in enumerate(s["turns"]):
            u = t["usage"]
            assert u["session_id"] == s["sid"] and u["node"] == f"node{i}"
            assert u["method"] == s["policy"].method
            if k > 0:  # later turns reuse the session's own earlier turn
                prev = s["turns"][k - 1]["usage"]
                assert u["prefix_hit_tokens"] >= prev["prompt_tokens"] - 1
            if s["policy"].evicts and k > 0:
                assert u["evicted_tokens"] > 0
        summary = engine.sessions.get(key(s["sid"]))
        assert summary is not None and summary.requests == TURNS
        assert summary.nodes == [f"node{i}"]
    engine.store.check_invariants()
    assert engine.store.stats().num_requests == 0

    # QueryMemory: exactly one per IntentKV session, none for FullCache sessions ...
    intent = [s for s in sessions if s["policy"].method == "intentkv"]
    full = [s for s in sessions if s["policy"].method == "full"]
    new = set(memory._store) - before
    assert new == {key(s["sid"]) for s in intent}
    assert not {key(s["sid"]) for s in full} & set(memory._store)
    # ... fed only by its own turns: replaying one session's requests alone, serially, under a
    # fresh id gives the same memory (another session's query mixed in would change it)
    for s in intent:
        replay = f"{s['sid']}-replay"
        for t in s["turns"]:
            payload = KVPayload(session_id=replay, policy=s["policy"])
            engine.chat(t["messages"], payload=payload, gen=GenerationConfig(max_tokens=1))
        got, want = memory.get(key(s["sid"])), memory.get(replay)
        assert got is not None and want is not None
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
        engine.end_session(replay)
        assert replay not in memory
    # distinct sessions hold distinct memories
    mems = [memory.get(key(s["sid"])) for s in intent]
    assert all(not torch.allclose(a, b) for j, a in enumerate(mems) for b in mems[j + 1 :])

    # end every session, flush the shared prefix cache: every slot is free again
    for s in sessions:
        engine.end_session(s["sid"], ns)
        assert key(s["sid"]) not in memory and engine.sessions.get(key(s["sid"])) is None
    engine.store.flush_prefix_cache()
    engine.store.check_invariants()
    stats = engine.store.stats()
    assert stats.free_slots == stats.capacity == engine.store.allocator.capacity
    assert stats.num_sessions == 0 and stats.prefix_cache_nodes == 0
