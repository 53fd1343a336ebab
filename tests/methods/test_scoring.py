"""Scorers on synthetic post-RoPE Q/K against straightforward reference computations.

The references restate the kvpress 0.5.5 definitions (see ../shared/methods/NOTES.md) on whole
tensors, the way kvpress computes them on one prefill; the methods see the same tensors
through their prefill observers, chunk by chunk, and a plan context.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agentkv.methods import ModelShape, ObserveRequest, PlanContext, method_class
from agentkv.methods.base import topk_positions
from agentkv.methods.intentkv import IntentKVMethod
from agentkv.methods.query_memory import QueryMemoryStore, normalize
from agentkv.policies import H2O, IntentKV, SnapKV, StreamingLLM

SHAPE = ModelShape(num_layers=2, num_q_heads=6, num_kv_heads=2, head_dim=16)
T = 96


@pytest.fixture
def qk():
    """Post-RoPE-like Q ``[L, Hq, T, D]`` and K ``[L, Hkv, T, D]`` with uneven attention."""
    g = torch.Generator().manual_seed(0)
    L, Hq, Hkv, D = 2, 6, 2, 16
    q = torch.randn(L, Hq, T, D, generator=g) * 1.5
    k = torch.randn(L, Hkv, T, D, generator=g)
    k[:, :, ::7] *= 2.5  # some keys stand out
    return q, k


def observe(method, policy, q, k, chunks=(0, 40, 75, T), num_cached=0, head_mask=None):
    """Feed the method's observer as the engine does: chunk by chunk, keys up to the chunk."""
    actionable = torch.zeros(T, dtype=torch.bool)
    actionable[T - 12 : T - 3] = True
    obs = method.observer(policy, ObserveRequest(T, num_cached, actionable, SHAPE))
    if obs is None:
        return None
    for layer in range(SHAPE.num_layers):
        for c0, c1 in zip(chunks[:-1], chunks[1:], strict=True):
            if c1 <= num_cached:
                continue
            c0 = max(c0, num_cached)
            hm = None if head_mask is None else head_mask[layer][:, :c1]
            obs.observe(
                layer,
                q[layer][:, c0:c1],
                torch.arange(c0, c1),
                k[layer][:, :c1],
                torch.arange(c1),
                hm,
            )
    return obs.result()


def context(policy, k, observation, live=None, forced=None, session="x:s"):
    actionable = torch.zeros(T, dtype=torch.bool)
    actionable[T - 12 : T - 3] = True
    if forced is None:
        forced = actionable.clone()
        forced[T - 3 :] = True  # tail
        forced[:10] = True  # protected prefix

    def read_keys(layer):
        keep = torch.ones(T, dtype=torch.bool) if live is None else live
        pos = torch.nonzero(keep).reshape(-1)
        return k[layer][:, pos].transpose(0, 1), pos, None

    return PlanContext(
        policy=policy,
        session_id=session,
        shape=SHAPE,
        seq_len=T,
        live=torch.ones(T, dtype=torch.bool) if live is None else live,
        forced=forced,
        actionable=actionable,
        tag_codes=torch.zeros(T, dtype=torch.uint8),
        read_keys=read_keys,
        observation=observation,
    )


def run(policy, q, k, **kw):
    method = method_class(policy.method)(SHAPE)
    obs = observe(method, policy, q, k, **{x: kw.pop(x) for x in list(kw) if x != "live"})
    return method, method.plan(context(policy, k, obs, live=kw.get("live")))


def full_attention(q, k, layer):
    """Causal softmax attention ``[Hq, T, T]`` of one layer, KV heads expanded."""
    kk = k[layer].repeat_interleave(SHAPE.group, dim=0)
    logits = q[layer] @ kk.transpose(1, 2) / math.sqrt(SHAPE.head_dim)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def keep_from_scores(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Top-``n`` per KV head (``scores [Hkv, T]``) as a bool mask."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(1, scores.topk(n, dim=-1).indices, True)
    return keep


# --------------------------------------------------------------------------- SnapKV


def snapkv_reference(q, k, layer, window, kernel):
    """kvpress SnapKVPress.score: window attention, mean, avg_pool1d, GQA mean, window at max."""
    attn = full_attention(q, k, layer)[:, -window:, :-window]  # [Hq, w, T - w]
    scores = attn.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(SHAPE.num_kv_heads, SHAPE.group, T - window).mean(1)
    return scores, F.pad(scores, (0, window), value=scores.max().item())


@pytest.mark.parametrize(("window", "kernel", "budget"), [(16, 5, 48), (8, 7, 30), (1, 1, 20)])
def test_snapkv_matches_kvpress(qk, window, kernel, budget):
    q, k = qk
    policy = SnapKV(budget=budget, window=window, kernel=kernel)
    _, plan = run(policy, q, k)
    assert plan.keep_mask is not None and plan.evict is None
    for layer in range(SHAPE.num_layers):
        pre, padded = snapkv_reference(q, k, layer, window, kernel)
        torch.testing.assert_close(plan.scores[layer][:, : T - window], pre, rtol=1e-4, atol=1e-6)
        expected = keep_from_scores(padded, budget)
        assert torch.equal(plan.keep_mask[layer], expected), layer
        assert bool(plan.keep_mask[layer][:, T - window :].all())  # window always kept
        assert plan.keep_mask[layer].sum(dim=-1).tolist() == [budget] * SHAPE.num_kv_heads
    # per KV head: the two heads do not keep the same set
    assert not torch.equal(plan.keep_mask[0][0], plan.keep_mask[0][1])


def test_snapkv_window_longer_than_budget_keeps_its_most_recent(qk):
    q, k = qk
    _, plan = run(SnapKV(budget=10, window=32, kernel=5), q, k)
    expected = torch.zeros(T, dtype=torch.bool)
    expected[T - 10 :] = True
    assert torch.equal(plan.keep_mask, expected.expand(SHAPE.num_layers, SHAPE.num_kv_heads, T))


def test_snapkv_window_is_new_queries_only(qk):
    """With a prefix-cache hit the window shrinks to the computed queries."""
    q, k = qk
    policy = SnapKV(budget=40, window=64, kernel=5)
    _, plan = run(policy, q, k, num_cached=T - 20)
    for layer in range(SHAPE.num_layers):
        _, padded = snapkv_reference(q, k, layer, 20, 5)
        assert torch.equal(plan.keep_mask[layer], keep_from_scores(padded, 40))


def test_snapkv_and_h2o_skip_what_a_head_already_lost(qk):
    """Per-head holes of an earlier turn: a head never spends budget on a key it lost."""
    q, k = qk
    head_mask = torch.ones(SHAPE.num_layers, SHAPE.num_kv_heads, T, dtype=torch.bool)
    head_mask[:, 0, ::2] = False  # KV head 0 lost every even position
    head_mask[:, :, T - 20 :] = True
    for policy in (SnapKV(budget=50, window=16), H2O(budget=50, recent=10)):
        method = method_class(policy.method)(SHAPE)
        obs = observe(method, policy, q, k, head_mask=head_mask)
        plan = method.plan(context(policy, k, obs))
        kept = plan.keep_mask & head_mask
        assert kept.sum(dim=-1).tolist() == [[50, 50]] * SHAPE.num_layers, policy.method


# ------------------------------------------------------------------------------ H2O


def h2o_reference(q, k, layer, num_cached=0):
    """kvpress ObservedAttentionPress.score over the queries computed (``num_cached..T-1``)."""
    attn = full_attention(q, k, layer)[:, num_cached:]  # [Hq, n_q, T]
    seen_by = torch.tensor([T - max(i, num_cached) for i in range(T)], dtype=torch.float32)
    scores = attn.sum(dim=1) / seen_by
    return scores.view(SHAPE.num_kv_heads, SHAPE.group, T).mean(1)


@pytest.mark.parametrize(("recent", "budget", "num_cached"), [(16, 40, 0), (0, 24, 0), (8, 32, 50)])
def test_h2o_matches_observed_attention_plus_recent(qk, recent, budget, num_cached):
    q, k = qk
    _, plan = run(H2O(budget=budget, recent=recent), q, k, num_cached=num_cached)
    for layer in range(SHAPE.num_layers):
        ref = h2o_reference(q, k, layer, num_cached)
        torch.testing.assert_close(plan.scores[layer], ref, rtol=1e-4, atol=1e-7)
        expected = torch.zeros(SHAPE.num_kv_heads, T, dtype=torch.bool)
        expected[:, T - recent :] = recent > 0
        expected[:, : T - recent] = keep_from_scores(ref[:, : T - recent], budget - recent)
        assert torch.equal(plan.keep_mask[layer], expected), layer
        assert plan.keep_mask[layer].sum(dim=-1).tolist() == [budget] * SHAPE.num_kv_heads


def test_h2o_recent_longer_than_budget(qk):
    q, k = qk
    _, plan = run(H2O(budget=12, recent=64), q, k)
    assert plan.keep_mask.sum(dim=-1).max() == 12
    assert bool(plan.keep_mask[:, :, T - 12 :].all())


# ----------------------------------------------------------------------- StreamingLLM


@pytest.mark.parametrize(("sinks", "budget"), [(4, 32), (0, 10), (9, 10)])
def test_streaming_llm_keeps_sinks_and_recent(qk, sinks, budget):
    q, k = qk
    _, plan = run(StreamingLLM(budget=budget, sinks=sinks), q, k)
    expected = set(range(sinks)) | set(range(T - (budget - sinks), T))
    assert set(range(T)) - set(plan.evict.tolist()) == expected


def test_streaming_llm_over_holes_counts_live_positions(qk):
    q, k = qk
    live = torch.ones(T, dtype=torch.bool)
    live[2:30] = False  # evicted in an earlier turn
    _, plan = run(StreamingLLM(budget=20, sinks=4), q, k, live=live)
    live_idx = torch.nonzero(live).reshape(-1).tolist()
    assert set(live_idx) - set(plan.evict.tolist()) == set(live_idx[:4] + live_idx[-16:])


@pytest.mark.parametrize(
    "policy", [SnapKV(budget=T), H2O(budget=T + 5), StreamingLLM(budget=T), IntentKV(budget=T)]
)
def test_nothing_evicted_within_budget(qk, policy):
    q, k = qk
    _, plan = run(policy, q, k)
    assert plan.is_noop and plan.note


# --------------------------------------------------------------------------- IntentKV


def test_topk_positions_prefers_earlier_on_ties():
    scores = torch.tensor([0.0, 0.5, 0.2, 0.5, 0.5, 0.2, 0.9, 0.0])
    candidates = torch.tensor([True, True, True, True, False, True, True, True])
    assert topk_positions(scores, candidates, 3).tolist() == [1, 3, 6]
    assert topk_positions(scores, candidates, 4).tolist() == [1, 2, 3, 6]
    assert topk_positions(scores, candidates, 0).tolist() == []
    assert topk_positions(scores, candidates, 10).tolist() == [0, 1, 2, 3, 5, 6, 7]
    flat = torch.zeros(8)
    assert topk_positions(flat, candidates, 2).tolist() == [0, 1]


def test_query_memory_update_math():
    store = QueryMemoryStore(capacity=4)
    g = torch.Generator().manual_seed(1)
    q1, q2, q3 = (torch.randn(2, 6, 16, generator=g) * 3 for _ in range(3))
    m1 = store.update("x:a", q1, decay=0.7)
    torch.testing.assert_close(m1, q1 / q1.norm(dim=-1, keepdim=True))
    m2 = store.update("x:a", q2, decay=0.7)
    ref = 0.7 * m1 + 0.3 * normalize(q2)  # the new query mixes in as a unit vector
    torch.testing.assert_close(m2, ref / ref.norm(dim=-1, keepdim=True))
    m3 = store.update("x:a", q3, decay=0.0)  # beta = 0: the current query alone
    torch.testing.assert_close(m3, normalize(q3))
    for m in (m1, m2, m3):
        torch.testing.assert_close(m.norm(dim=-1), torch.ones(2, 6))
    assert torch.equal(store.get("x:a"), m3)


def test_query_memory_sessions_lru_and_request_local():
    store = QueryMemoryStore(capacity=2)
    a, b, c = (torch.full((1, 1, 4), float(v)) for v in (1, 2, 3))
    store.update("x:a", a, 0.5)
    store.update("x:b", -a, 0.5)
    assert not torch.equal(store.get("x:a"), store.get("x:b"))  # disjoint per session
    store.get("x:a")  # a is now the most recent
    store.update("x:c", c, 0.5)
    assert "x:a" in store and "x:c" in store and "x:b" not in store and len(store) == 2
    # request-local sessions are used once and never stored, so never matched
    m = store.update("req:0123", b, 0.5)
    torch.testing.assert_close(m, normalize(b))
    assert "req:0123" not in store and len(store) == 2
    assert torch.equal(store.update("req:0123", -b, 0.5), normalize(-b))
    store.drop("x:a")
    assert "x:a" not in store
    with pytest.raises(ValueError):
        QueryMemoryStore(capacity=0)


def intentkv_reference(q_probe, k, candidates):
    """NOTES rule score: mean over layers and query heads of softmax over candidates."""
    scores = torch.zeros(T)
    idx = torch.nonzero(candidates).reshape(-1)
    for layer in range(SHAPE.num_layers):
        for h in range(SHAPE.num_q_heads):
            kv = k[layer, h // SHAPE.group][idx]  # [n, D]
            p = torch.softmax(kv @ q_probe[layer, h] / math.sqrt(SHAPE.head_dim), dim=0)
            scores[idx] += p
    return scores / (SHAPE.num_layers * SHAPE.num_q_heads)


def test_intentkv_rule_score_forced_set_and_budget(qk):
    q, k = qk
    policy = IntentKV(budget=30)
    method = IntentKVMethod(SHAPE)
    obs = observe(method, policy, q, k)
    q_bar = q[:, :, T - 12 : T - 3].mean(dim=2)  # the actionable span
    torch.testing.assert_close(obs, q_bar)
    ctx = context(policy, k, obs, session="x:rule")
    plan = method.plan(ctx)
    candidates = ~ctx.forced
    ref = intentkv_reference(normalize(q_bar), k, candidates)  # first turn: m = normalize(q_bar)
    torch.testing.assert_close(plan.scores, ref, rtol=1e-5, atol=1e-7)
    assert float(plan.scores[candidates].sum()) == pytest.approx(1.0, rel=1e-5)
    kept = torch.ones(T, dtype=torch.bool)
    kept[plan.evict] = False
    assert bool(kept[ctx.forced].all())  # forced set kept
    # total budget: the forced set first, the best candidates up to `budget` live positions
    n_cand = policy.budget - int(ctx.forced.sum())
    assert n_cand > 0 and int((kept & candidates).sum()) == n_cand
    top = ref[candidates].topk(n_cand).values.min()
    assert bool((ref[kept & candidates] >= top).all())
    # second turn: the memory mixes the first turn's intent with the new query
    q2 = q.flip(2)
    plan2 = method.plan(context(policy, k, observe(method, policy, q2, k), session="x:rule"))
    m2 = normalize(0.5 * normalize(q_bar) + 0.5 * normalize(q2[:, :, T - 12 : T - 3].mean(dim=2)))
    torch.testing.assert_close(
        plan2.scores, intentkv_reference(m2, k, candidates), rtol=1e-5, atol=1e-7
    )
    # mode "query" scores with normalize(q_bar): it differs from memory mode only by the memory
    qpolicy = IntentKV(budget=30, mode="query")
    plan3 = method.plan(context(qpolicy, k, observe(method, qpolicy, q2, k), session="x:q"))
    q2_bar = q2[:, :, T - 12 : T - 3].mean(dim=2)
    torch.testing.assert_close(
        plan3.scores, intentkv_reference(normalize(q2_bar), k, candidates), rtol=1e-5, atol=1e-7
    )


def test_intentkv_without_actionable_tokens_uses_the_tail_window(qk):
    q, k = qk
    method = IntentKVMethod(SHAPE)
    policy = IntentKV()
    obs = method.observer(policy, ObserveRequest(T, 0, torch.zeros(T, dtype=torch.bool), SHAPE))
    for layer in range(SHAPE.num_layers):
        obs.observe(layer, q[layer], torch.arange(T), k[layer], torch.arange(T), None)
    w = policy.fallback_window
    torch.testing.assert_close(obs.result(), q[:, :, -w:].mean(dim=2))


# --------------------------------------------------------------------------- host reads


def _plan_on_device(policy, layers: int, device: bool):
    """One plan of ``policy`` on a ``layers``-layer shape, keys (and the observed prefill) on
    the emulated device of :mod:`device_reads` (``device``) or the CPU. Returns the plan, the
    reads of the observer's result and of the plan, and the ops mixing host and device."""
    from device_reads import DeviceReads, on_device

    from agentkv.methods.intentkv_head import HeadConfig, ResidualHead

    shape = ModelShape(layers, 6, 2, 16)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(layers, 6, T, 16, generator=g) * 1.5
    k = torch.randn(layers, 2, T, 16, generator=g)
    wrap = on_device if device else (lambda t: t)
    method = method_class(policy.method)(shape)
    if policy.method == "intentkv":
        torch.manual_seed(0)
        head = ResidualHead(HeadConfig.for_shape(shape))
        torch.nn.init.normal_(head.mlp[2].weight, std=2.0)  # not the rule
        method.use_head(head)
    actionable = torch.zeros(T, dtype=torch.bool)
    actionable[T - 12 : T - 3] = True
    forced = actionable.clone()
    forced[T - 3 :] = forced[:10] = True
    live = torch.ones(T, dtype=torch.bool)
    live[20:30] = False  # an earlier turn's holes
    pos = torch.nonzero(live).reshape(-1)
    keys = [(wrap(k[i][:, pos].transpose(0, 1).contiguous()), wrap(pos)) for i in range(layers)]
    obs = method.observer(policy, ObserveRequest(T, 0, actionable, shape))
    with DeviceReads() as observed:
        for layer in range(layers):
            ar = wrap(torch.arange(T))
            obs.observe(layer, wrap(q[layer]), ar, wrap(k[layer]), ar, None)
        result = obs.result()
    ctx = PlanContext(
        policy=policy,
        session_id="x:reads",
        shape=shape,
        seq_len=T,
        live=live,
        forced=forced,
        actionable=actionable,
        tag_codes=torch.zeros(T, dtype=torch.uint8),
        read_keys=lambda layer: (*keys[layer], None),
        observation=result,
    )
    with DeviceReads() as planned:
        plan = method.plan(ctx)
    return plan, observed, planned


@pytest.mark.parametrize(
    ("policy", "reads"),
    [
        (IntentKV(budget=30), 2),
        (IntentKV(budget=30, mode="query"), 2),
        (IntentKV(budget=30, mode="learned"), 2),
        (SnapKV(budget=30), 3),
        (H2O(budget=30), 2),
    ],
    ids=["intentkv-memory", "intentkv-query", "intentkv-learned", "snapkv", "h2o"],
)
def test_a_plan_reads_back_to_the_host_a_bounded_number_of_times(policy, reads):
    """Keys and the observed prefill on an (emulated) accelerator: the plan's device-to-host
    reads do not grow with the layers. IntentKV scores and ranks on the keys' device and
    reads the keep mask and the scores once (the learned head's inputs, scores and key means,
    instead); SnapKV and H2O rank on their observer's device and read the keep mask and the
    scores (SnapKV also which keys each layer saw). No op mixes a host tensor with a device
    one (a GPU would refuse it), and the plans are the CPU's, bit for bit."""
    for layers in (2, 6):
        plan, observed, planned = _plan_on_device(policy, layers, device=True)
        assert planned.count == reads, planned.ops
        assert observed.count <= 1, observed.ops  # IntentKV's q_bar; SnapKV, H2O: none
        assert observed.mixed == [] and planned.mixed == []
        cpu, _, _ = _plan_on_device(policy, layers, device=False)
        assert not plan.is_noop
        for a, b in ((plan.evict, cpu.evict), (plan.keep_mask, cpu.keep_mask)):
            assert (a is None and b is None) or torch.equal(a, b)
