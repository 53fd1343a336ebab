"""Prefix-cache reuse across the turns of a session, for FullCache and for an evicting policy.

Turn ``k`` of a session must reuse what turn ``k-1`` cached (prompt and decoded tokens), and
under IntentKV the positions evicted in turn ``k-1`` must come back as holes in turn ``k``:
same DEAD positions, the same physical slots for every kept position, counts that add up.
"""

from __future__ import annotations

import pytest
import torch

from agentkv.cache import DEAD
from agentkv.engine.engine import GenerationConfig
from agentkv.policies import FullCache, IntentKV
from agentkv.wire import KVPayload

pytestmark = pytest.mark.slow

BUDGET = 8
FOLLOW_UPS = ["Which one is the warmest?", "Name a fruit of that color."]


def run_session(engine, monkeypatch, sid, policy, turns=3, max_tokens=5):
    """Multi-turn chat; returns per turn (usage, slot map after the request, prompt tags)."""
    requests = []
    begin = engine.store.begin_request

    def spy(session_id, token_ids, **kw):
        req = begin(session_id, token_ids, **kw)
        requests.append(req)
        return req

    monkeypatch.setattr(engine.store, "begin_request", spy)
    messages = [
        {"role": "system", "content": f"{sid}: you are a terse assistant."},
        {"role": "user", "content": "Name three colors of the rainbow."},
    ]
    out = []
    try:
        for turn in range(turns):
            tags = engine.renderer.encode(messages)
            payload = KVPayload(session_id=sid, policy=policy)
            res = engine.chat(
                messages, payload=payload, gen=GenerationConfig(max_tokens=max_tokens)
            )
            engine.store.check_invariants()
            out.append((res, requests[-1].slot_map.slots.clone(), tags))
            messages += [
                {"role": "assistant", "content": res.content},
                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
            ]
    finally:
        monkeypatch.undo()
    assert len(requests) == turns
    return out


def kv_len(res) -> int:
    """Positions with KV after a request: the prompt + decoded tokens that were fed back (the
    last one is not when decoding stopped at max_tokens)."""
    fed = len(res.token_ids) - (1 if res.finish_reason == "length" else 0)
    return res.usage.prompt_tokens + fed


@pytest.mark.parametrize(
    "policy", [FullCache(), IntentKV(budget=BUDGET)], ids=["full", f"intentkv{BUDGET}"]
)
def test_turns_reuse_prefix_and_keep_holes(engine, monkeypatch, sid, policy):
    turns = run_session(engine, monkeypatch, sid, policy)
    total_evicted = 0
    for k, (res, slots, tags) in enumerate(turns):
        u = res.usage
        assert u.session_id == sid and u.method == policy.method
        # slots: [L * Hkv, T] cells; token-level eviction: a position is DEAD in every column
        assert slots.shape[1] == kv_len(res)
        dead = (slots == DEAD).all(dim=0)
        assert torch.equal(dead, (slots == DEAD).any(dim=0))
        assert u.prompt_tokens == len(tags)
        assert u.peak_request_tokens == u.prompt_tokens + u.completion_tokens
        assert u.prefix_hit_rate == pytest.approx(u.prefix_hit_tokens / u.prompt_tokens)
        # live KV (no per-head eviction here) = positions with KV minus holes
        assert u.live_kv_tokens == pytest.approx(slots.shape[1] - int(dead.sum()))
        assert u.resident_kv_tokens == slots.shape[1] - int(dead.sum())
        assert u.live_kv_bytes == int(u.live_kv_tokens * engine.store.pool.bytes_per_token)
        shape = engine.shape  # token-level eviction: every layer and KV head of a position
        assert u.evicted_entries == u.evicted_tokens * shape.num_layers * shape.num_kv_heads
        if k == 0:  # only the template's opening can be shared with other conversations
            # a new conversation: at most the template's opening and a few id characters
            # (the random session id may share its first hex digits with another test's)
            assert u.prefix_hit_tokens < 8
            assert int(dead.sum()) == u.evicted_tokens
        else:
            prev_res, prev_slots, prev_tags = turns[k - 1]
            assert u.prefix_hit_tokens >= len(prev_tags) - 1
            assert u.prefix_hit_tokens <= min(prev_slots.shape[1], u.prompt_tokens - 1)
            hit = u.prefix_hit_tokens
            prev, cur = prev_slots[:, :hit], slots[:, :hit]
            # holes of the previous turn stay holes; kept positions keep their slots
            assert bool((cur[prev == DEAD] == DEAD).all())
            kept = (prev != DEAD) & (cur != DEAD)
            assert torch.equal(cur[kept], prev[kept])
            # this turn's dead = inherited holes + what this turn's plan evicted
            assert int(dead.sum()) == int((prev == DEAD).all(dim=0).sum()) + u.evicted_tokens
        total_evicted += u.evicted_tokens
        if policy.evicts:
            forced = sum(tags.forced(True))
            assert u.live_kv_tokens <= forced + BUDGET + u.completion_tokens
            if k > 0:  # the history outgrew the budget
                assert u.evicted_tokens > 0
                assert u.live_kv_tokens < kv_len(res)
        else:
            assert u.evicted_tokens == 0 and not bool(dead.any())
    summary = engine.sessions.get(sid)
    assert summary is not None and summary.requests == len(turns)
    assert summary.evicted_tokens == total_evicted
    assert summary.prefix_hit_tokens == sum(r.usage.prefix_hit_tokens for r, _, _ in turns)
    engine.end_session(sid)
    assert engine.sessions.get(sid) is None
    engine.store.check_invariants()


def test_decode_reads_metrics(engine, sid):
    """raw KV reads = keys a full cache attends over the decode steps; effective = keys
    attended after eviction (every step skips the same holes)."""
    messages = [
        {"role": "system", "content": f"{sid}: answer briefly."},
        {"role": "user", "content": "List the planets of the solar system, please."},
        {"role": "assistant", "content": "Mercury, Venus, Earth, Mars, Jupiter, Saturn."},
        {"role": "user", "content": "Which one is the largest?"},
    ]
    for policy in (FullCache(), IntentKV(budget=4)):
        payload = KVPayload(session_id=f"{sid}-{policy.method}", policy=policy)
        res = engine.chat(messages, payload=payload, gen=GenerationConfig(max_tokens=6))
        u = res.usage
        t = u.prompt_tokens
        steps = kv_len(res) - t  # forward passes after prefill
        raw = sum(t + j + 1 for j in range(steps))
        assert u.raw_kv_reads == raw
        assert u.effective_kv_reads == raw - steps * u.evicted_tokens
        assert u.wall_time_s > 0
        if policy.evicts:
            assert u.evicted_tokens > 0 and u.effective_kv_reads < u.raw_kv_reads


def test_plan_does_not_depend_on_other_sessions_cache(engine, sid):
    """The same IntentKV request in a fresh session, after another session cached the same
    prompt, gets the same QueryMemory and the same evictions: the actionable query is always
    computed (its queries feed q-bar), never taken from the prefix cache."""
    messages = [
        {"role": "system", "content": f"{sid}: be brief."},
        {"role": "user", "content": "My cat is called Tom and he is grey."},
        {"role": "assistant", "content": "Tom sounds like a lovely grey cat!"},
        {"role": "user", "content": "What colour is my cat?"},
    ]
    policy = IntentKV(budget=4)
    memory = engine.methods.for_policy(policy).memory
    tags = engine.renderer.encode(messages)
    first_actionable = tags.actionable.index(True)

    def chat(who, policy):
        payload = KVPayload(session_id=f"{sid}-{who}", policy=policy)
        return engine.chat(messages, payload=payload, gen=GenerationConfig(max_tokens=2)).usage

    # FullCache has no prefill observer: it reuses all but the last prompt token
    # a new conversation shares at most the template's opening and a few id characters
    assert chat("full1", FullCache()).prefix_hit_tokens < 8
    assert chat("full2", FullCache()).prefix_hit_tokens == len(tags) - 1
    # IntentKV recomputes from the actionable query on, whatever the cache holds
    a, b = chat("a", policy), chat("b", policy)
    assert a.prefix_hit_tokens == b.prefix_hit_tokens == first_actionable
    assert a.evicted_tokens == b.evicted_tokens > 0
    assert a.live_kv_tokens == b.live_kv_tokens
    ma, mb = memory.get(f"{sid}-a"), memory.get(f"{sid}-b")
    assert torch.allclose(ma, mb, atol=1e-5), float((ma - mb).abs().max())
    # ... and it is what a cold cache gives
    engine.store.flush_prefix_cache()
    c = chat("c", policy)
    assert c.prefix_hit_tokens == 0 and c.evicted_tokens == a.evicted_tokens
    mc = memory.get(f"{sid}-c")
    assert torch.allclose(ma, mc, atol=1e-5), float((ma - mc).abs().max())
    for who in ("full1", "full2", "a", "b", "c"):
        engine.end_session(f"{sid}-{who}")
