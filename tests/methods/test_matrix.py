"""One matrix runs every KV method through the same checks on the real engine.

As kvpress runs every press through one test matrix: each entry of :data:`METHOD_CASES` is a
policy at a small budget; :func:`test_method` is parametrised over it and drives two turns of
a real session (SmolLM2-135M, a real tau-bench airline conversation with a system prompt, a
tool schema, a tool call, its result and a user question; ~600 tokens) through the embedded
engine. A new method joins by adding one line to :data:`METHOD_CASES` (and, if it always keeps
some positions, one entry to :func:`always_kept`). Threshold methods (KVzap) have no budget:
their bound is the prompt length, and they must still evict on this prompt.

Checks: the budget holds after the plan (IntentKV: live tokens <= max(budget, forced set),
or budget + forced set with ``budget_scope="history"``; per-head baselines: live entries per
(layer, KV head) <= budget), resident bytes follow the
decision (evicting methods: within 10% of their effective bytes; quantizing methods: every
cell before the residual window quantized), decode only appends;
FullCache evicts nothing and answers exactly like a request without a payload; the positions
a method promises to keep are live; the store's reference counts and locks are consistent
while the request is in flight and after; the session's next turn reuses the whole previous
prompt from the prefix cache despite the holes.
"""

from __future__ import annotations

import pytest
import torch

from agentkv import (
    H2O,
    FullCache,
    IntentKV,
    KVPolicy,
    KVzap,
    SnapKV,
    StreamingLLM,
    UniformQuant,
    build_payload,
)
from agentkv.cache import Precision

pytestmark = pytest.mark.slow

BUDGET = 96
METHOD_CASES = [
    pytest.param(FullCache(), id="full"),
    pytest.param(StreamingLLM(budget=BUDGET, sinks=4), id="streamingllm"),
    pytest.param(SnapKV(budget=BUDGET, window=16, kernel=5), id="snapkv"),
    pytest.param(H2O(budget=BUDGET, recent=16), id="h2o"),
    pytest.param(IntentKV(budget=BUDGET, protect_system=False), id="intentkv"),
    pytest.param(IntentKV(budget=BUDGET, budget_scope="history"), id="intentkv-history"),
    pytest.param(UniformQuant(bits=4, residual=64), id="uniform_quant-4"),
    pytest.param(UniformQuant(bits=2, residual=64), id="uniform_quant-2"),
    pytest.param(KVzap(threshold=-5.0, window=16), id="kvzap"),
]
REPLY = "Yes: HAT083 leaves JFK at 3:00 PM EST and lands in Seattle at 9:00 PM EST."
NEXT_USER = {"role": "user", "content": "The 3 PM flight works. Please book it with my card."}


def keeps_forced_set(policy: KVPolicy) -> bool:
    """Methods that keep whole positions: a forced set, then the best candidates."""
    return isinstance(policy, IntentKV)


def always_kept(policy: KVPolicy, T: int, forced: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: positions the method promises to keep in every layer and head."""
    keep = torch.zeros(T, dtype=torch.bool)
    if isinstance(policy, FullCache):
        keep[:] = True
    elif isinstance(policy, IntentKV):
        keep |= forced
    elif isinstance(policy, StreamingLLM):
        keep[: policy.sinks] = True
        keep[T - (policy.budget - policy.sinks) :] = True
    elif isinstance(policy, SnapKV):
        keep[T - min(policy.window, policy.budget) :] = True
    elif isinstance(policy, H2O):
        keep[T - min(policy.recent, policy.budget) :] = True
    elif isinstance(policy, KVzap):
        keep[T - policy.window :] = True
    return keep


def budget_bound(policy: KVPolicy, T: int, n_forced: int) -> int:
    """Live KV tokens allowed right after the plan (threshold methods: no budget)."""
    if not policy.evicts or not hasattr(policy, "budget"):
        return T
    if isinstance(policy, IntentKV):
        if policy.budget_scope == "history":
            return policy.budget + n_forced
        return max(policy.budget, n_forced)
    return policy.budget


def encode(engine, messages, tools, payload):
    return engine.renderer.encode(messages, tools, payload.messages)


def test_full_cache_matches_no_payload(engine, airline_request):
    """FullCache is no compression: same tokens as a request without an agentkv payload."""
    from agentkv.engine.engine import GenerationConfig

    messages, tools = airline_request
    gen = GenerationConfig(max_tokens=4)
    plain = engine.chat(messages, tools, gen=gen)
    full = engine.chat(
        messages, tools, payload=build_payload(messages, FullCache(), "x:matrix-full"), gen=gen
    )
    assert full.token_ids == plain.token_ids and full.text == plain.text
    for u in (plain.usage, full.usage):
        assert u.method == "full" and u.evicted_tokens == 0 and u.evicted_entries == 0
        assert u.compression_ratio == 0.0
        assert u.prompt_tokens <= u.live_kv_tokens <= u.prompt_tokens + u.completion_tokens
    engine.end_session(plain.usage.session_id)
    engine.end_session("x:matrix-full")
    engine.store.check_invariants()


@pytest.mark.parametrize("policy", METHOD_CASES)
def test_method(engine, airline_cached, policy):
    """Turn 1 through the public :meth:`Engine.compress` (prefill + plan on the tagged chat;
    the per-cell decision comes back). Turn 2 of the same session through ``Engine.chat``:
    prefix reuse over the holes and quantized cells, budget after decode, resident bytes."""
    from agentkv.engine.engine import GenerationConfig

    messages, tools = airline_cached
    sid = f"x:matrix-{policy.method}"
    payload = build_payload(messages, policy, sid)
    tags = encode(engine, messages, tools, payload)
    T = len(tags)
    assert 300 < T < 700  # a few hundred tokens, several times the budget
    res1 = engine.compress(tags, policy, session_id=sid)
    engine.store.check_invariants()
    forced = res1.forced
    kept, prec, u1 = res1.kept, res1.precision, res1.usage
    L, H = kept.shape[:2]
    assert tuple(kept.shape) == (L, H, T) and bool(torch.isfinite(res1.logits).all())
    per_head = kept.sum(dim=-1)  # [L, Hkv]
    resident = kept.any(dim=1).any(dim=0)
    assert bool(kept.all(dim=1).all(dim=0)[always_kept(policy, T, forced)].all()), (
        "a promised position was evicted"
    )
    bound = budget_bound(policy, T, int(forced.sum()))
    assert int(per_head.max()) <= bound
    if policy.evicts:
        assert u1.evicted_entries == per_head.numel() * T - int(per_head.sum()) > 0
        assert u1.evicted_tokens == int((~resident).sum())
        if hasattr(policy, "budget"):  # T is well above it: the budget is used in full
            assert int(per_head.min()) == bound
            assert u1.evicted_tokens > 0
        # memory is freed at the grain of the decision: resident bytes follow live cells
        assert u1.resident_kv_bytes <= 1.10 * u1.live_kv_bytes
    else:
        assert u1.evicted_entries == u1.evicted_tokens == 0 and bool(kept.all())
    if policy.quantizes:
        bits = int(policy.bits)
        cut = T - policy.residual
        assert bool((prec[:, :, cut:] == int(Precision.FULL)).all())  # the residual window
        quantized = prec[:, :, :cut]
        assert bool(((quantized == bits) | (quantized == int(Precision.INT4))).all())
        assert int((quantized == bits).sum()) >= 0.9 * quantized.numel()
        assert u1.quantized_entries == quantized.numel()
        assert u1.resident_kv_bytes < 0.5 * u1.live_kv_bytes
        assert u1.resident_kv_bytes_by_precision[f"int{bits}"] > 0
    else:
        assert bool(((prec == int(Precision.FULL)) | ~kept).all()) and u1.quantized_entries == 0
    if keeps_forced_set(policy):
        # the forced set and the best candidates up to the bound, whole positions
        assert int(resident.sum()) == bound and bool(resident[forced].all())
        assert bool((kept == resident).all())

    turn2 = messages + [{"role": "assistant", "content": REPLY}, NEXT_USER]
    payload2 = build_payload(turn2, policy, sid)
    tags2 = encode(engine, turn2, tools, payload2)
    res = engine.chat(turn2, tools, payload=payload2, gen=GenerationConfig(max_tokens=2))
    engine.store.check_invariants()
    u = res.usage
    assert u.prompt_tokens == len(tags2) and u.method == policy.method
    # the whole previous prompt comes back from the prefix cache, holes included
    assert u.prefix_hit_tokens >= T - 1
    # decode appends at most one KV token per generated token
    protect = engine.methods.for_policy(policy).protects_system(policy)
    n_forced = sum(tags2.forced(protect))
    assert u.live_kv_tokens <= budget_bound(policy, len(tags2), n_forced) + u.completion_tokens
    if policy.evicts:
        assert u.evicted_entries > 0
    else:
        assert u.evicted_tokens == 0 and u.live_kv_tokens >= u.prompt_tokens
    engine.end_session(sid)
    engine.store.check_invariants()
