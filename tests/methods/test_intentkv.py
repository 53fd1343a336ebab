"""IntentKV on the real engine: rule score, forced set, QueryMemory across turns and sessions.

The engine's own IntentKV instance is observed (its ``plan`` wrapped, nothing replaced): each
record holds the real plan context, the plan, the keys the plan read and the session memory
after the update. Scores are recomputed by brute force from the NOTES formula::

    s_i = 1/(L Hq) sum_l sum_h softmax_{j in C}(m[l,h] . K[l, h//g, j] / sqrt(D))_i
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from agentkv import IntentKV, build_payload
from agentkv.cache import DEAD
from agentkv.methods import Plan, PlanContext
from agentkv.methods.query_memory import normalize

pytestmark = pytest.mark.slow

NEXT_USER = {"role": "user", "content": "The 3 PM flight works. Please book it with my card."}


@dataclass
class Record:
    ctx: PlanContext
    plan: Plan
    keys: list  # per layer: (k [n, Hkv, D], positions [n], head_mask | None), before the plan
    memory: torch.Tensor | None  # the session's memory after this request's update


@pytest.fixture
def intentkv(engine, monkeypatch):
    """``(method, records)``: the engine's IntentKV instance, with every plan recorded."""
    method = engine.methods.for_policy(IntentKV())
    records: list[Record] = []
    real_plan = method.plan

    def plan(ctx: PlanContext) -> Plan:
        keys = []
        for layer in range(ctx.shape.num_layers):
            k, pos, hm = ctx.read_keys(layer)
            keys.append((k.float().cpu().clone(), pos.cpu().clone(), hm))
        out = real_plan(ctx)
        mem = method.memory.get(ctx.session_id)
        records.append(Record(ctx, out, keys, None if mem is None else mem.clone()))
        return out

    monkeypatch.setattr(method, "plan", plan)
    return method, records


def brute_rule_score(probe: torch.Tensor, keys, candidates: torch.Tensor, T: int) -> torch.Tensor:
    """float64 ``[T]``: the NOTES rule score, one (layer, query head) at a time."""
    L, Hq, D = probe.shape
    scores = torch.zeros(T, dtype=torch.float64)
    for layer, (k, pos, hm) in enumerate(keys):
        assert hm is None  # IntentKV evicts whole positions
        cand = candidates[pos]
        kc, pc = k[cand].double(), pos[cand]
        g = Hq // k.shape[1]
        for h in range(Hq):
            logits = kc[:, h // g] @ probe[layer, h].double() / math.sqrt(D)
            scores[pc] += torch.softmax(logits, dim=0)
    return scores / (L * Hq)


def chat(engine, messages, tools, policy, sid, max_tokens=1):
    from agentkv.engine.engine import GenerationConfig

    payload = build_payload(messages, policy, sid)
    return engine.chat(
        messages, tools, payload=payload, gen=GenerationConfig(max_tokens=max_tokens)
    )


def check_rule_plan(rec: Record, probe: torch.Tensor, budget: int) -> torch.Tensor:
    """Scores equal the brute force; kept = forced + the ``budget`` best candidates."""
    ctx, plan = rec.ctx, rec.plan
    T = ctx.seq_len
    candidates = ctx.live & ~ctx.forced
    assert int(candidates.sum()) > budget
    brute = brute_rule_score(probe, rec.keys, candidates, T)
    torch.testing.assert_close(plan.scores.double(), brute, rtol=1e-4, atol=1e-9)
    assert float(brute[candidates].sum()) == pytest.approx(1.0, rel=1e-6)
    evicted = torch.zeros(T, dtype=torch.bool)
    evicted[plan.evict] = True
    assert not bool((evicted & ctx.forced).any())
    kept = candidates & ~evicted
    assert int(kept.sum()) == budget and bool((evicted <= candidates).all())
    assert float(brute[kept].min()) >= float(brute[candidates & evicted].max()) - 1e-9
    return brute


def test_rule_score_forced_set_and_cached_holes(engine, airline_cached, intentkv):
    method, records = intentkv
    messages, tools = airline_cached
    policy, sid = IntentKV(budget=64), "x:intentkv-rule"
    res = chat(engine, messages, tools, policy, sid)
    (rec,) = records
    q_bar = rec.ctx.observation
    # first turn: m = normalize(q_bar), unit norm per (layer, head)
    torch.testing.assert_close(rec.memory, normalize(q_bar))
    torch.testing.assert_close(rec.memory.norm(dim=-1), torch.ones(q_bar.shape[:2]))
    check_rule_plan(rec, rec.memory, policy.budget)
    assert res.usage.evicted_tokens == rec.plan.evict.numel()
    # the finished request's prefix-cache entry holds exactly the plan's holes
    T = rec.ctx.seq_len
    tokens = torch.tensor(engine.renderer.encode(messages, tools).token_ids)
    match = engine.store.prefix_cache.match(sid, tokens, max_len=T)
    assert match.length == T and match.from_session
    cells = match.slots[:, :T]  # [L * Hkv, T]: whole positions evicted in every column
    dead = torch.nonzero((cells == DEAD).all(dim=0)).reshape(-1)
    assert dead.tolist() == sorted(rec.plan.evict.tolist())
    assert bool((cells[:, rec.ctx.forced] != DEAD).all())
    engine.end_session(sid)
    engine.store.check_invariants()


def test_nothing_evicted_when_history_fits(engine, airline_cached, intentkv):
    _, records = intentkv
    messages, tools = airline_cached
    res = chat(engine, messages, tools, IntentKV(budget=4096), "x:intentkv-fits")
    (rec,) = records
    assert rec.plan.is_noop and "nothing evicted" in rec.plan.note
    assert res.usage.evicted_tokens == 0 and res.usage.live_kv_tokens >= res.usage.prompt_tokens
    assert rec.memory is not None  # the memory still follows the session
    engine.end_session("x:intentkv-fits")


def test_memory_across_turns_modes_and_sessions(engine, airline_cached, intentkv):
    method, records = intentkv
    messages, tools = airline_cached
    beta = 0.7
    mem_policy = IntentKV(budget=64, memory_decay=beta)
    query_policy = IntentKV(budget=64, memory_decay=beta, mode="query")
    sm, sq = "x:intentkv-memory", "x:intentkv-query"

    # turn 1 of both sessions, then turn 2
    r1 = chat(engine, messages, tools, mem_policy, sm)
    chat(engine, messages, tools, query_policy, sq)
    turn2 = messages + [{"role": "assistant", "content": r1.text}, NEXT_USER]
    chat(engine, turn2, tools, mem_policy, sm)
    chat(engine, turn2, tools, query_policy, sq)
    m1, q1, m2, q2 = records
    assert [r.ctx.session_id for r in records] == [sm, sq, sm, sq]

    # memory recurrence: m2 = normalize(beta * m1 + (1 - beta) * q_bar2), unit norm
    torch.testing.assert_close(m1.memory, normalize(m1.ctx.observation))
    expected = normalize(beta * m1.memory + (1 - beta) * m2.ctx.observation)
    torch.testing.assert_close(m2.memory, expected)
    torch.testing.assert_close(m2.memory.norm(dim=-1), torch.ones(m2.memory.shape[:2]))
    assert not torch.allclose(m2.memory, normalize(m2.ctx.observation), atol=1e-3)

    # turn 2 scores: memory mode with m2, query mode with its own q_bar
    check_rule_plan(m2, m2.memory, 64)
    check_rule_plan(q2, q2.ctx.observation, 64)
    cand_q = q2.ctx.live & ~q2.ctx.forced
    with_memory = brute_rule_score(q2.memory, q2.keys, cand_q, q2.ctx.seq_len)
    assert not torch.allclose(q2.plan.scores.double(), with_memory, atol=1e-5)
    assert set(q2.plan.evict.tolist()) != set(m2.plan.evict.tolist())

    # another session starts from its own query, and leaves these memories alone
    before = method.memory.get(sm).clone()
    other = messages[:-1] + [{"role": "user", "content": "What is my membership tier?"}]
    chat(engine, other, tools, mem_policy, "x:intentkv-other")
    o = records[-1]
    torch.testing.assert_close(o.memory, normalize(o.ctx.observation))
    assert torch.equal(method.memory.get(sm), before)
    # a request-local session is scored with its own query and never stored
    chat(engine, other, tools, mem_policy, "req:intentkv-local")
    r = records[-1]
    assert r.memory is None and "req:intentkv-local" not in method.memory
    check_rule_plan(r, normalize(r.ctx.observation), 64)
    for sid in (sm, sq, "x:intentkv-other", "req:intentkv-local"):
        engine.end_session(sid)
    assert sm not in method.memory
    engine.store.check_invariants()
