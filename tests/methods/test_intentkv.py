"""IntentKV on the real engine: budget semantics, rule score, forced set, QueryMemory across
turns and sessions, the fallback query.

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


def check_rule_plan(rec: Record, probe: torch.Tensor, keep_n: int) -> torch.Tensor:
    """Scores equal the brute force; kept = forced + the ``keep_n`` best candidates."""
    ctx, plan = rec.ctx, rec.plan
    T = ctx.seq_len
    candidates = ctx.live & ~ctx.forced
    assert int(candidates.sum()) > keep_n > 0
    brute = brute_rule_score(probe, rec.keys, candidates, T)
    torch.testing.assert_close(plan.scores.double(), brute, rtol=1e-4, atol=1e-9)
    assert float(brute[candidates].sum()) == pytest.approx(1.0, rel=1e-6)
    evicted = torch.zeros(T, dtype=torch.bool)
    evicted[plan.evict] = True
    assert not bool((evicted & ctx.forced).any())
    kept = candidates & ~evicted
    assert int(kept.sum()) == keep_n and bool((evicted <= candidates).all())
    assert float(brute[kept].min()) >= float(brute[candidates & evicted].max()) - 1e-9
    return brute


def n_forced(engine, messages, tools, policy: IntentKV) -> int:
    return sum(engine.renderer.encode(messages, tools).forced(policy.protect_system))


def test_total_budget_rule_score_and_cached_holes(engine, airline_cached, intentkv):
    """The paper's reading: live KV after the plan = max(B, |forced|), the rest by score."""
    method, records = intentkv
    messages, tools = airline_cached
    F = n_forced(engine, messages, tools, IntentKV())
    policy, sid = IntentKV(budget=F + 64), "x:intentkv-rule"
    res = chat(engine, messages, tools, policy, sid)
    (rec,) = records
    assert int(rec.ctx.forced.sum()) == F
    q_bar = rec.ctx.observation
    # first compression event: m = normalize(q_bar), unit norm per (layer, head)
    torch.testing.assert_close(rec.memory, normalize(q_bar))
    torch.testing.assert_close(rec.memory.norm(dim=-1), torch.ones(q_bar.shape[:2]))
    check_rule_plan(rec, rec.memory, 64)
    T = rec.ctx.seq_len
    assert T - rec.plan.evict.numel() == policy.budget  # total live KV = B
    assert res.usage.evicted_tokens == rec.plan.evict.numel()
    # the finished request's prefix-cache entry holds exactly the plan's holes
    tokens = torch.tensor(engine.renderer.encode(messages, tools).token_ids)
    match = engine.store.prefix_cache.match(sid, tokens, max_len=T)
    assert match.length == T and match.from_session
    cells = match.slots[:, :T]  # [L * Hkv, T]: whole positions evicted in every column
    dead = torch.nonzero((cells == DEAD).all(dim=0)).reshape(-1)
    assert dead.tolist() == sorted(rec.plan.evict.tolist())
    assert bool((cells[:, rec.ctx.forced] != DEAD).all())
    engine.end_session(sid)
    engine.store.check_invariants()


def test_budget_below_forced_set_and_history_scope(engine, airline_cached, intentkv):
    """B < |forced|: only the forced set stays. ``budget_scope="history"``: B on top of it."""
    _, records = intentkv
    messages, tools = airline_cached
    F = n_forced(engine, messages, tools, IntentKV())
    chat(engine, messages, tools, IntentKV(budget=F // 2), "x:intentkv-tight")
    tight = records[-1]
    T = tight.ctx.seq_len
    assert (
        sorted(tight.plan.evict.tolist()) == torch.nonzero(~tight.ctx.forced).reshape(-1).tolist()
    )
    assert "fills the budget" in tight.plan.note and T - tight.plan.evict.numel() == F
    assert tight.memory is not None  # still a compression event: the memory moves
    chat(engine, messages, tools, IntentKV(budget=64, budget_scope="history"), "x:intentkv-hist")
    hist = records[-1]
    check_rule_plan(hist, hist.memory, 64)
    assert T - hist.plan.evict.numel() == F + 64
    for sid in ("x:intentkv-tight", "x:intentkv-hist"):
        engine.end_session(sid)
    engine.store.check_invariants()


def test_memory_moves_only_in_compression_events(engine, airline_cached, intentkv):
    """A request under budget evicts nothing and leaves the session memory alone (the paper's
    appendix: the memory updates after the skip test); the next compression event starts it."""
    method, records = intentkv
    messages, tools = airline_cached
    sid = "x:intentkv-fits"
    res = chat(engine, messages, tools, IntentKV(budget=4096), sid)
    (rec,) = records
    assert rec.plan.is_noop and "nothing evicted" in rec.plan.note
    assert res.usage.evicted_tokens == 0 and res.usage.live_kv_tokens >= res.usage.prompt_tokens
    assert rec.memory is None and sid not in method.memory
    turn2 = messages + [{"role": "assistant", "content": res.text}, NEXT_USER]
    chat(engine, turn2, tools, IntentKV(budget=128, protect_system=False), sid)
    ev = records[-1]
    assert not ev.plan.is_noop
    torch.testing.assert_close(ev.memory, normalize(ev.ctx.observation))
    engine.end_session(sid)


def test_memory_across_turns_modes_and_sessions(engine, airline_cached, intentkv):
    method, records = intentkv
    messages, tools = airline_cached
    beta = 0.7
    mem_policy = IntentKV(budget=160, memory_decay=beta, protect_system=False)
    query_policy = mem_policy.model_copy(update={"mode": "query"})
    sm, sq = "x:intentkv-memory", "x:intentkv-query"

    # turn 1 of both sessions, then turn 2
    r1 = chat(engine, messages, tools, mem_policy, sm)
    chat(engine, messages, tools, query_policy, sq)
    turn2 = messages + [{"role": "assistant", "content": r1.text}, NEXT_USER]
    chat(engine, turn2, tools, mem_policy, sm)
    chat(engine, turn2, tools, query_policy, sq)
    m1, q1, m2, q2 = records
    assert [r.ctx.session_id for r in records] == [sm, sq, sm, sq]
    keep2 = 160 - int((m2.ctx.live & m2.ctx.forced).sum())

    # memory recurrence on directions: m2 = normalize(beta m1 + (1 - beta) normalize(q_bar2))
    torch.testing.assert_close(m1.memory, normalize(m1.ctx.observation))
    q_hat2 = normalize(m2.ctx.observation)
    torch.testing.assert_close(m2.memory, normalize(beta * m1.memory + (1 - beta) * q_hat2))
    torch.testing.assert_close(m2.memory.norm(dim=-1), torch.ones(m2.memory.shape[:2]))
    # the memory remembers turn 1: closer to m1 than to the new query (beta > 1/2)
    cos_old = (m2.memory * m1.memory).sum(-1)
    cos_new = (m2.memory * q_hat2).sum(-1)
    assert bool((cos_old > cos_new).all())

    # turn 2 scores: memory mode with m2, query mode with normalize(q_bar): the same norm, so
    # the modes differ by the memory only; query mode never stores a memory
    check_rule_plan(m2, m2.memory, keep2)
    check_rule_plan(q2, normalize(q2.ctx.observation), keep2)
    assert q1.memory is None and q2.memory is None and sq not in method.memory
    cand_q = q2.ctx.live & ~q2.ctx.forced
    with_memory = brute_rule_score(m2.memory, q2.keys, cand_q, q2.ctx.seq_len)
    assert not torch.allclose(q2.plan.scores.double(), with_memory, atol=1e-5)

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
    check_rule_plan(r, normalize(r.ctx.observation), 160 - int((r.ctx.live & r.ctx.forced).sum()))
    for sid in (sm, sq, "x:intentkv-other", "req:intentkv-local"):
        engine.end_session(sid)
    assert sm not in method.memory
    engine.store.check_invariants()


def test_fallback_query_is_the_tail_window(engine, airline_cached, intentkv):
    """No actionable message: q_bar averages the last ``fallback_window`` positions, and the
    engine recomputes them even when the prefix cache holds the whole prompt, so a warm and a
    cold request score with the same query."""
    from agentkv import FullCache
    from agentkv.engine.engine import GenerationConfig

    _, records = intentkv
    messages, tools = airline_cached

    def no_actionable(sid: str, window: int) -> Record:
        policy = IntentKV(budget=128, protect_system=False, fallback_window=window)
        payload = build_payload(messages, policy, sid)
        anns = [a.model_copy(update={"actionable": False}) for a in payload.messages]
        payload = payload.model_copy(update={"messages": anns})
        engine.chat(messages, tools, payload=payload, gen=GenerationConfig(max_tokens=1))
        engine.end_session(sid)
        return records[-1]

    warm = no_actionable("req:fallback-warm", 16)  # the prompt sits in the prefix cache
    assert not bool(warm.ctx.actionable.any()) and not warm.plan.is_noop
    engine.store.flush_prefix_cache()
    cold = no_actionable("req:fallback-cold", 16)
    torch.testing.assert_close(warm.ctx.observation, cold.ctx.observation, rtol=1e-4, atol=1e-4)
    # a window, not the last token's query alone
    one = no_actionable("req:fallback-one", 1)
    assert not torch.allclose(one.ctx.observation, cold.ctx.observation, atol=1e-3)
    # warm the shared prefix cache again for the tests that follow
    payload = build_payload(messages, FullCache(), "x:methods-warmup")
    engine.chat(messages, tools, payload=payload, gen=GenerationConfig(max_tokens=1))
    engine.end_session("x:methods-warmup")
    engine.store.check_invariants()


def test_learned_mode_with_an_untrained_head_is_the_rule(
    engine, airline_cached, intentkv, tmp_path, monkeypatch
):
    """Phase-2 at initialisation: s~ = log(|C| s) exactly, so the plan is the memory rule's."""
    from agentkv.methods.intentkv_head import HEAD_FILE, HEADS_ENV, HeadConfig, ResidualHead

    method, records = intentkv
    ResidualHead(HeadConfig.for_shape(engine.shape, model="untrained")).save(
        tmp_path / "untrained" / HEAD_FILE
    )
    monkeypatch.setenv(HEADS_ENV, str(tmp_path))
    monkeypatch.setattr(method, "_head", None)
    messages, tools = airline_cached
    rule = IntentKV(budget=160, protect_system=False)
    chat(engine, messages, tools, rule, "x:intentkv-rule-twin")
    chat(engine, messages, tools, rule.model_copy(update={"mode": "learned"}), "x:intentkv-learned")
    r, lr = records[-2:]
    assert method.head().config.model == "untrained"
    assert torch.equal(r.plan.evict, lr.plan.evict) and lr.plan.evict.numel() > 0
    cand = lr.ctx.live & ~lr.ctx.forced
    expected = torch.log(r.plan.scores[cand].double() * int(cand.sum())).float()
    torch.testing.assert_close(lr.plan.scores[cand], expected)
    assert bool(torch.isinf(lr.plan.scores[~cand]).all())
    for sid in ("x:intentkv-rule-twin", "x:intentkv-learned"):
        engine.end_session(sid)


def test_learned_mode_uses_the_calibrated_alpha_max(
    engine, airline_cached, intentkv, tmp_path, monkeypatch
):
    """A head whose residual is not zero, calibrated to alpha_max = 0 (the head did not beat
    the rule): the default learned mode is the rule; an explicit alpha_max brings it back."""
    from agentkv.methods.intentkv_head import HEAD_FILE, HEADS_ENV, HeadConfig, ResidualHead

    method, records = intentkv
    torch.manual_seed(0)
    head = ResidualHead(HeadConfig.for_shape(engine.shape, model="calibrated"))
    torch.nn.init.normal_(head.mlp[2].weight, std=2.0)
    head.calibrated_alpha_max = 0.0
    head.save(tmp_path / "calibrated" / HEAD_FILE)
    monkeypatch.setenv(HEADS_ENV, str(tmp_path))
    monkeypatch.setattr(method, "_head", None)
    messages, tools = airline_cached
    rule = IntentKV(budget=160, protect_system=False)
    learned = rule.model_copy(update={"mode": "learned"})
    chat(engine, messages, tools, rule, "x:intentkv-cal-rule")
    chat(engine, messages, tools, learned, "x:intentkv-cal-default")
    chat(engine, messages, tools, learned.model_copy(update={"alpha_max": 1.0}), "x:intentkv-cal-1")
    r, default, one = records[-3:]
    assert method.head().calibrated_alpha_max == 0.0
    cand = default.ctx.live & ~default.ctx.forced
    expected = torch.log(r.plan.scores[cand].double() * int(cand.sum())).float()
    torch.testing.assert_close(default.plan.scores[cand], expected)  # s~ = the rule exactly
    assert torch.equal(r.plan.evict, default.plan.evict)
    assert not torch.allclose(one.plan.scores[cand], expected)  # the residual is back
    for sid in ("x:intentkv-cal-rule", "x:intentkv-cal-default", "x:intentkv-cal-1"):
        engine.end_session(sid)


def test_learned_mode_ablations(engine, airline_cached, intentkv, tmp_path, monkeypatch):
    """The paper's Phase-2 ablations on one trained-looking head: ``rule`` ranks by the
    residual alone (s~ minus the rule's logit), ``cross_attention`` is the head with its
    readout c forced to 0 (a head whose output projection of c is zero gives the same scores),
    ``memory`` scores a session's turn 2 with the current query (as a request-local session,
    which holds no memory) and leaves the session memory where it was."""
    import copy

    from agentkv.methods.intentkv_head import HEAD_FILE, HEADS_ENV, HeadConfig, ResidualHead

    method, records = intentkv
    torch.manual_seed(1)
    head = ResidualHead(HeadConfig.for_shape(engine.shape, model="ablations"))
    torch.nn.init.normal_(head.mlp[2].weight, std=2.0)
    head.save(tmp_path / "ablations" / HEAD_FILE)
    monkeypatch.setenv(HEADS_ENV, str(tmp_path))
    monkeypatch.setattr(method, "_head", None)
    messages, tools = airline_cached
    full = IntentKV(budget=160, protect_system=False, mode="learned", alpha_max=1.0)

    def run(policy: IntentKV, sid: str, msgs=messages) -> Record:
        chat(engine, msgs, tools, policy, sid)
        return records[-1]

    rule_only = run(full.model_copy(update={"mode": "memory"}), "req:abl-rule")
    both = run(full, "req:abl-full")
    head_only = run(full.model_copy(update={"ablate": "rule"}), "req:abl-head")
    no_xattn = run(full.model_copy(update={"ablate": "cross_attention"}), "req:abl-xattn")
    cand = both.ctx.live & ~both.ctx.forced
    logit = torch.log(rule_only.plan.scores[cand].double() * int(cand.sum())).float()
    torch.testing.assert_close(head_only.plan.scores[cand], both.plan.scores[cand] - logit)
    assert not torch.equal(head_only.plan.evict, rule_only.plan.evict)
    zero_c = copy.deepcopy(method.head())
    torch.nn.init.zeros_(zero_c.attn_o.weight)
    torch.nn.init.zeros_(zero_c.attn_o.bias)
    method.use_head(zero_c)
    twin = run(full, "req:abl-zero-c")
    method.use_head(None)
    torch.testing.assert_close(no_xattn.plan.scores[cand], twin.plan.scores[cand])
    assert not torch.allclose(no_xattn.plan.scores[cand], both.plan.scores[cand])

    # memory ablation on a session's second turn: with a zero residual it is the query mode
    # (two sessions with the same turn 1, so the same holes), and the memory stays put
    turn2 = messages + [{"role": "assistant", "content": "ok"}, NEXT_USER]
    for sid in ("x:abl-memory", "x:abl-query"):
        run(full, sid)
    memory = method.memory.get("x:abl-memory").clone()
    method.use_head(ResidualHead(HeadConfig.for_shape(engine.shape, model="zero")))
    without = run(full.model_copy(update={"ablate": "memory"}), "x:abl-memory", turn2)
    query = run(full.model_copy(update={"mode": "query"}), "x:abl-query", turn2)
    method.use_head(None)
    assert torch.equal(method.memory.get("x:abl-memory"), memory)  # neither read nor moved
    c2 = query.ctx.live & ~query.ctx.forced
    assert torch.equal(without.ctx.live, query.ctx.live) and int(c2.sum()) > 0
    expected = torch.log(query.plan.scores[c2].double() * int(c2.sum())).float()
    torch.testing.assert_close(without.plan.scores[c2], expected)
    for sid in ("x:abl-memory", "x:abl-query"):
        engine.end_session(sid)


def test_ablate_needs_the_learned_mode():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="ablate"):
        IntentKV(ablate="memory")
    assert IntentKV(mode="learned", ablate="cross_attention").ablate == "cross_attention"
