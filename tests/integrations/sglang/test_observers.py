"""Prefill observers fed from an SGLang extend batch (``observe_extend``): each request's
query rows, positions and live keys (holes dropped, cached prefix included) reach its observer
exactly as the method would see them fed directly; then the plan lands on the row."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from agentkv.integrations.sglang.request_plan import (
    HOLEY,
    evicted_positions,
    plan_request,
    request_state,
)
from agentkv.integrations.sglang.runtime import OBSERVING, before_extend, observe_extend, plan_one
from agentkv.integrations.sglang.usage import USAGE_KEY, UsageColumn
from agentkv.methods.base import ObserveRequest
from agentkv.policies import IntentKV, SnapKV
from agentkv.wire import KVPayload, encode_payload


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 30000, (n,), generator=g).tolist()


def scheduler_of(steps) -> SimpleNamespace:
    """What ``before_extend`` reads of SGLang's scheduler, over the ``steps`` fixture's pools."""
    return SimpleNamespace(
        token_to_kv_pool_allocator=steps.alloc,
        model_config=SimpleNamespace(num_attention_heads=steps.planner.shape.num_q_heads),
        tp_size=1,
    )


def one_request_extend(r, pre: int, n: int, host_lens: bool = False):
    """SGLang's ``ForwardBatch`` of one extend of request ``r``: ``n`` rows after ``pre``
    computed positions; ``host_lens``: with the lengths' host lists, as SGLang fills them."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor([r.req_pool_idx]),
        seq_lens=torch.tensor([pre + n]),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        seq_lens_sum=pre + n,
        positions=torch.arange(pre, pre + n),
        extend_start_loc=torch.tensor([0]),
        extend_seq_lens=torch.tensor([n]),
        extend_prefix_lens=torch.tensor([pre]),
        extend_seq_lens_cpu=[n] if host_lens else None,
        extend_prefix_lens_cpu=[pre] if host_lens else None,
    )


def test_observers_see_each_requests_rows_and_live_keys(steps):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    pol_a = SnapKV(budget=12, window=6)
    pol_b = IntentKV(budget=10, mode="query", fallback_window=4)
    a = steps.request(
        tokens(40, 10), encode_payload(KVPayload(session_id="a", policy=pol_a)), rid="a"
    )
    b = steps.request(
        tokens(30, 11), encode_payload(KVPayload(session_id="b", policy=pol_b)), rid="b"
    )
    c = steps.request(
        tokens(25, 14),
        encode_payload(KVPayload(session_id="c", policy=IntentKV(budget=8, mode="query"))),
        rid="c",
    )
    steps.prefill(a, plan=False)
    steps.prefill(b, plan=False)
    steps.prefill(c, plan=False)
    dead = steps.alloc.dead_slot
    HOLEY.dead_slot = dead
    # b's first 10 positions play a cached prefix with two holes an earlier turn left
    steps.r2t.req_to_token[b.req_pool_idx, 2] = dead
    steps.r2t.req_to_token[b.req_pool_idx, 5] = dead
    prefix = [0, 10, 0]
    lens = [40, 20, 25]
    sched = scheduler_of(steps)
    import agentkv.integrations.sglang.runtime as runtime

    runtime._PLANNER = steps.planner
    for r, pre in zip((a, b, c), prefix, strict=True):
        r.prefix_indices = steps.row(r)[:pre]
        request_state(r).planned = False
    runtime.reset_extend_rows()
    before_extend(sched, SimpleNamespace(reqs=[a, b, c]))
    assert set(OBSERVING) == {a.req_pool_idx, b.req_pool_idx, c.req_pool_idx}
    # usage.agentkv: each request got its column; b's prefix holes are counted
    assert all(isinstance(r.customized_info[USAGE_KEY], UsageColumn) for r in (a, b, c))
    # b's session prefix may hold holes: holey until its plan counts them (no read here)
    assert request_state(a).dead_in_prefix == 0 and not request_state(a).holey
    assert request_state(b).holey and request_state(b).dead_in_prefix == 0

    shape = steps.planner.shape
    hq, d = shape.num_q_heads, shape.head_dim
    n = sum(lens)
    positions = torch.cat([torch.arange(p, p + m) for p, m in zip(prefix, lens, strict=True)])
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=3,
        input_ids=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor([a.req_pool_idx, b.req_pool_idx, c.req_pool_idx]),
        seq_lens=torch.tensor([40, 30, 25]),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        seq_lens_sum=95,
        positions=positions,
        extend_start_loc=torch.tensor([0, 40, 60]),
        extend_seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.tensor(prefix),
    )
    backend = SimpleNamespace(token_to_kv_pool=steps.kv, req_to_token=steps.r2t.req_to_token)
    torch.manual_seed(0)
    qs = [torch.randn(n, hq * d) for _ in range(shape.num_layers)]
    for layer in range(shape.num_layers):
        attn = RadixAttention(hq, d, d**-0.5, shape.num_kv_heads, layer)
        observe_extend(backend, qs[layer], attn, fb)
    runtime.reset_extend_rows()  # as run_batch does after the forward: the sums handed out

    # the same observers fed directly
    for r, start, pre, m in ((a, 0, 0, 40), (b, 40, 10, 20), (c, 60, 0, 25)):
        state = request_state(r)
        method = steps.planner.methods.for_policy(state.payload.policy)
        ref = method.observer(
            state.payload.policy,
            ObserveRequest(len(state.tags), pre, torch.tensor(state.tags.actionable), shape),
        )
        row = steps.row(r)[: pre + m]
        live = torch.nonzero(row != dead).reshape(-1)
        for layer in range(shape.num_layers):
            q = qs[layer][start : start + m].reshape(m, hq, d).transpose(0, 1)
            k = steps.kv.get_key_buffer(layer)[row[live]].transpose(0, 1)
            ref.observe(layer, q, torch.arange(pre, pre + m), k, live, None)
        got, want = state.observer.result(), ref.result()
        for x, y in zip(
            got if isinstance(got, tuple) else [got],
            want if isinstance(want, tuple) else [want],
            strict=True,
        ):
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y)
            else:
                for f in ("sums", "counts", "seen"):
                    torch.testing.assert_close(getattr(x, f), getattr(y, f))
        live_mask = (steps.row(r)[: len(state.tags)] != dead).cpu()
        want_dead = None
        if r is a:  # SnapKV is stateless: plan it once more from the same observation
            row_now = steps.row(r)

            def read_keys(layer, row=row_now, lm=live_mask):
                pos = torch.nonzero(lm).reshape(-1)
                return steps.kv.get_key_buffer(layer)[row[pos]], pos, None

            plan = plan_request(state, steps.planner.methods, shape, live_mask, read_keys)
            want_dead = evicted_positions(plan, len(state.tags))
        n_dead = plan_one(steps.planner, steps.r2t, steps.alloc, r, state)
        assert n_dead > 0 and state.planned and state.observer is None
        assert state.dead_in_prefix == (2 if r is b else 0)  # the prefix's holes, counted
        assert state.usage["live_kv_tokens"] == len(state.tags) - state.dead_in_prefix - n_dead
        now_dead = torch.nonzero(steps.row(r)[: len(state.tags)] == dead).reshape(-1)
        assert (
            now_dead.numel()
            <= len(state.tags) - min(len(state.tags), state.payload.policy.budget) + 2
        )
        if want_dead is not None:
            assert torch.equal(now_dead, want_dead)
    assert not OBSERVING
    for r in (a, b, c):
        steps.finish(r)
    steps.cache.check_invariants()


def test_a_retracted_request_rerun_with_its_output_observes_its_prompt_only(steps):
    """SGLang runs a retracted request's prefill again over prompt + generated tokens; the
    observer was made for the prompt: it sees the prompt's rows and keys (as if fed directly)
    and the plan covers the prompt. (On the H100 an H2O observer indexed past its prompt.)"""
    from sglang.srt.layers.radix_attention import RadixAttention

    import agentkv.integrations.sglang.runtime as runtime
    from agentkv.policies import H2O

    T, extra = 30, 5
    r = steps.request(
        tokens(T, 12), encode_payload(KVPayload(session_id="r", policy=H2O(budget=12, recent=4)))
    )
    steps.prefill(r, plan=False)
    steps.decode(r, tokens(extra, 13))  # the output a retraction re-runs
    HOLEY.dead_slot = steps.alloc.dead_slot
    runtime._PLANNER = steps.planner
    state = request_state(r)
    state.planned, state.observer = False, None
    r.prefix_indices = steps.row(r)[:0]
    sched = scheduler_of(steps)
    before_extend(sched, SimpleNamespace(reqs=[r]))
    shape = steps.planner.shape
    hq, d, n = shape.num_q_heads, shape.head_dim, T + extra
    fb = one_request_extend(r, 0, n)
    backend = SimpleNamespace(token_to_kv_pool=steps.kv, req_to_token=steps.r2t.req_to_token)
    torch.manual_seed(1)
    qs = [torch.randn(n, hq * d) for _ in range(shape.num_layers)]
    method = steps.planner.methods.for_policy(state.payload.policy)
    ref = method.observer(
        state.payload.policy,
        ObserveRequest(T, 0, torch.tensor(state.tags.actionable), shape),
    )
    row = steps.row(r)
    for layer in range(shape.num_layers):
        observe_extend(
            backend, qs[layer], RadixAttention(hq, d, d**-0.5, shape.num_kv_heads, layer), fb
        )
        q = qs[layer][:T].reshape(T, hq, d).transpose(0, 1)
        k = steps.kv.get_key_buffer(layer)[row[:T]].transpose(0, 1)
        ref.observe(layer, q, torch.arange(T), k, torch.arange(T), None)
    got, want = state.observer.result(), ref.result()
    for f in ("sums", "counts", "seen"):
        torch.testing.assert_close(getattr(got, f), getattr(want, f))
    assert plan_one(steps.planner, steps.r2t, steps.alloc, r, state) == T - 12
    assert (steps.row(r)[T:] != steps.alloc.dead_slot).all()  # the output stays
    steps.finish(r)
    steps.cache.check_invariants()


def _plan_reads(steps, policy, host_reads) -> tuple[int, list[str], torch.Tensor]:
    """Prefill a request of ``policy`` with two holes (an earlier turn's), feed its observer
    every layer's queries directly, then count the host reads of ``plan_one``. Returns the
    count, the ops and the row's DEAD positions after the plan."""
    steps.alloc.strict = False  # strict mode checks every free eagerly (a read each)
    T = 48
    r = steps.request(tokens(T, 20), encode_payload(KVPayload(session_id="h", policy=policy)))
    steps.prefill(r, plan=False)
    dead = steps.alloc.dead_slot
    HOLEY.dead_slot = dead
    row = steps.r2t.req_to_token[r.req_pool_idx]
    steps.alloc.free(row[[3, 7]].to(torch.int64))  # the holes' slots go, as a plan frees them
    row[[3, 7]] = dead
    state = request_state(r)
    shape = steps.planner.shape
    method = steps.planner.methods.for_policy(policy)
    state.observer = method.observer(
        policy, ObserveRequest(T, 0, torch.tensor(state.tags.actionable), shape)
    )
    live = torch.nonzero(steps.row(r) != dead).reshape(-1)
    torch.manual_seed(2)
    for layer in range(shape.num_layers):
        q = torch.randn(shape.num_q_heads, T, shape.head_dim)
        k = steps.kv.get_key_buffer(layer)[steps.row(r)[live]].transpose(0, 1)
        state.observer.observe(layer, q, torch.arange(T), k / 1000, live, None)
    with host_reads:
        n = plan_one(steps.planner, steps.r2t, steps.alloc, r, state)
    ops = list(host_reads.ops)
    assert n > 0 and state.usage["live_kv_tokens"] == T - 2 - n
    now_dead = torch.nonzero(steps.row(r) == dead).reshape(-1)
    assert now_dead.numel() == n + 2
    steps.finish(r)
    steps.cache.check_invariants()
    return len(ops), ops, now_dead


def test_a_plan_reads_the_host_as_often_whatever_the_layers(steps_factory, host_reads):
    """``plan_one`` of an IntentKV request (the rule scored over every layer's keys): the
    host reads are as many with 6 layers as with 2, and few. On the CPU the counter sees
    the ops that would read back on a GPU, host-side ones included (an upper bound), not
    copies (``.cpu()`` is no op there; ``tests/methods/test_scoring.py`` counts them on an
    emulated device). Before the scoring moved to the keys' device this was 12 + L here
    (the candidate test per layer; the per-layer copies of positions and scores unseen)."""
    from agentkv.policies import IntentKV

    policy = IntentKV(budget=20, mode="query", fallback_window=4)
    counts = []
    for layers in (2, 6):
        count, ops, _ = _plan_reads(steps_factory(layers=layers), policy, host_reads)
        assert count <= 8, ops
        counts.append(count)
    assert counts[0] == counts[1], counts


def _observe_reads(steps, policy, host_lens: bool) -> tuple[Any, Any, Any]:
    """One request of ``policy`` (a cached prefix of 8 with a hole, 24 new rows) observed over
    every layer of an extend batch whose tensors (queries, positions, pool indices,
    ``req_to_token``, the KV pool) sit on the emulated device of :mod:`device_reads`, as
    ``Scheduler.run_batch`` drives it (``before_extend``, the layers, ``reset_extend_rows``).
    Returns the device reads of the layers, the observer's result and the result of the same
    observer fed directly (live keys only)."""
    from device_reads import DeviceReads, DeviceTensor, on_device
    from sglang.srt.layers.radix_attention import RadixAttention

    import agentkv.integrations.sglang.runtime as runtime

    T, pre = 32, 8
    r = steps.request(tokens(T, 30), encode_payload(KVPayload(session_id="o", policy=policy)))
    steps.prefill(r, plan=False)
    dead = steps.alloc.dead_slot
    HOLEY.dead_slot = dead
    steps.r2t.req_to_token[r.req_pool_idx, 3] = dead
    runtime._PLANNER = steps.planner
    state = request_state(r)
    state.planned, state.observer = False, None
    r.prefix_indices = steps.row(r)[:pre]
    runtime.reset_extend_rows()
    before_extend(scheduler_of(steps), SimpleNamespace(reqs=[r]))  # the scheduler's host
    shape = steps.planner.shape
    hq, d, n = shape.num_q_heads, shape.head_dim, T - pre
    fb = one_request_extend(r, pre, n, host_lens)
    for f in ("req_pool_indices", "positions", "extend_seq_lens", "extend_prefix_lens"):
        setattr(fb, f, on_device(getattr(fb, f)))
    kv = SimpleNamespace(get_key_buffer=lambda layer: on_device(steps.kv.get_key_buffer(layer)))
    backend = SimpleNamespace(token_to_kv_pool=kv, req_to_token=on_device(steps.r2t.req_to_token))
    torch.manual_seed(3)
    qs = [torch.randn(n, hq * d) for _ in range(shape.num_layers)]
    with DeviceReads() as reads:
        for layer in range(shape.num_layers):
            attn = RadixAttention(hq, d, d**-0.5, shape.num_kv_heads, layer)
            observe_extend(backend, on_device(qs[layer]), attn, fb)
        runtime.reset_extend_rows()  # the batch's query sums handed out (IntentKV)
    with DeviceReads():
        got = state.observer.result()
        if isinstance(got, torch.Tensor):
            got = got.cpu()
        else:  # AttentionColumnSums: its buffers, back on the host
            for f in ("sums", "counts", "seen", "head_live"):
                t = getattr(got, f)
                setattr(got, f, t.elem if isinstance(t, DeviceTensor) else t)
    method = steps.planner.methods.for_policy(policy)
    ref = method.observer(
        policy, ObserveRequest(T, pre, torch.tensor(state.tags.actionable), shape)
    )
    row = steps.row(r)[:T]
    live = torch.nonzero(row != dead).reshape(-1)
    for layer in range(shape.num_layers):
        q = qs[layer].reshape(n, hq, d).transpose(0, 1)
        k = steps.kv.get_key_buffer(layer)[row[live]].transpose(0, 1)
        ref.observe(layer, q, torch.arange(pre, T), k, live, None)
    want = ref.result()
    OBSERVING.clear()
    steps.finish(r)
    return reads, got, want


def test_observing_an_extend_batch_reads_nothing_back(steps_factory):
    """With the extend batch on an (emulated) accelerator, feeding the observers every layer
    makes the host wait for nothing: the pool indices come from the scheduler's ``Req``
    objects (``before_extend``), the lengths from SGLang's host lists, IntentKV's query sums
    (``sums_queries``) from rows picked on the host, and SnapKV's keys are its row's every
    slot with DEAD masked rather than the live ones selected. The results equal the observers
    fed directly with the live keys. Without SGLang's host lists the two lengths are read
    back. (Before session 10: the pool indices were read back at the first layer of every
    extend batch, and a key-reading observer's live positions once per request.)"""
    from agentkv.policies import H2O

    intent = IntentKV(budget=10, mode="query", fallback_window=4)
    for layers in (2, 6):
        reads, got, want = _observe_reads(steps_factory(layers=layers), intent, True)
        assert reads.count == 0 and reads.mixed == [], (reads.ops, reads.mixed)
        torch.testing.assert_close(got, want)
    reads, _, _ = _observe_reads(steps_factory(layers=2), intent, False)
    assert reads.ops == ["tolist", "tolist"]  # extend_seq_lens and extend_prefix_lens
    for policy in (SnapKV(budget=12, window=6), H2O(budget=12, recent=4)):
        reads, got, want = _observe_reads(steps_factory(layers=2), policy, True)
        assert reads.count == 0 and reads.mixed == [], (reads.ops, reads.mixed)
        for f in ("sums", "counts", "seen", "head_live"):
            torch.testing.assert_close(getattr(got, f), getattr(want, f))


def test_before_extend_leaves_an_evicting_requests_holes_to_its_plan(steps, host_reads):
    """A session prefix may hold DEAD. For an evicting request ``before_extend`` marks it
    holey without reading anything (its plan reads the row and counts the holes); a request
    that plans nothing (FullCache) has its holes counted there, one read."""
    import agentkv.integrations.sglang.runtime as runtime
    from agentkv.policies import FullCache, IntentKV

    runtime._PLANNER = steps.planner
    dead = steps.alloc.dead_slot
    HOLEY.dead_slot = dead
    states = {}
    for rid, policy in (("e", IntentKV(budget=10, mode="query")), ("f", FullCache())):
        r = steps.request(tokens(24, 40), encode_payload(KVPayload(session_id=rid, policy=policy)))
        steps.prefill(r, plan=False)
        steps.r2t.req_to_token[r.req_pool_idx, 4] = dead  # an earlier turn's hole
        r.prefix_indices = steps.row(r)[:8]  # matched in the session's namespace
        state = request_state(r)
        state.planned, state.observer = False, None
        with host_reads:
            before_extend(scheduler_of(steps), SimpleNamespace(reqs=[r]))
        states[rid] = (r, state, host_reads.count)
    (e, se, reads_e), (f, sf, reads_f) = states["e"], states["f"]
    assert reads_e == 0 and se.holey and se.dead_in_prefix == 0
    assert reads_f == 1 and sf.holey and sf.dead_in_prefix == 1
    plan_one(steps.planner, steps.r2t, steps.alloc, e, se)
    assert se.dead_in_prefix == 1 and se.holey  # counted by the plan, from its one row read
    OBSERVING.clear()
    for r in (e, f):
        steps.finish(r)
    steps.cache.check_invariants()


def test_an_entry_left_by_an_earlier_holder_of_the_row_is_not_fed(steps):
    """SGLang reuses ``req_pool_idx``. An observer-table entry whose request the scheduler no
    longer holds is dropped at the next extend batch (``drop_orphan_observers``), and one
    whose request is still held elsewhere (here: waiting) is not fed the rows of the request
    now holding its row. (On the H100 a StreamingLLM run, whose requests observe nothing,
    spent 1.6 s feeding entries of an earlier run's requests.)"""
    from sglang.srt.layers.radix_attention import RadixAttention

    import agentkv.integrations.sglang.runtime as runtime
    from agentkv.integrations.sglang.hidden_states import HIDDEN_OBSERVING, observe_layer_input
    from agentkv.methods.base import PrefillObserver
    from agentkv.policies import FullCache

    class Boom(PrefillObserver):
        reads_keys = False

        def observe(self, *args):
            raise AssertionError("fed")

        def observe_hidden(self, *args):
            raise AssertionError("fed")

    T = 20
    r = steps.request(tokens(T, 40), encode_payload(KVPayload(session_id="n", policy=FullCache())))
    steps.prefill(r, plan=False)
    r.prefix_indices = steps.row(r)[:0]
    runtime._PLANNER = steps.planner
    left = SimpleNamespace(observer=Boom(), prompt_rows=lambda prefix, n: n)
    sched = scheduler_of(steps)
    try:
        # nobody holds its request any more: dropped
        OBSERVING[r.req_pool_idx] = HIDDEN_OBSERVING[r.req_pool_idx] = left
        OBSERVING[999] = left
        before_extend(sched, SimpleNamespace(reqs=[r]))
        assert not OBSERVING and not HIDDEN_OBSERVING
        runtime.reset_extend_rows()
        # its request waits (a retracted one, say): kept, but not fed another's rows
        sched.waiting_queue = [SimpleNamespace(agentkv=left)]
        OBSERVING[r.req_pool_idx] = HIDDEN_OBSERVING[r.req_pool_idx] = left
        before_extend(sched, SimpleNamespace(reqs=[r]))
        assert OBSERVING[r.req_pool_idx] is left
        shape = steps.planner.shape
        hq, d = shape.num_q_heads, shape.head_dim
        fb = one_request_extend(r, 0, T, host_lens=True)
        backend = SimpleNamespace(token_to_kv_pool=steps.kv, req_to_token=steps.r2t.req_to_token)
        attn = RadixAttention(hq, d, d**-0.5, shape.num_kv_heads, 0)
        observe_extend(backend, torch.randn(T, hq * d), attn, fb)
        observe_layer_input(0, torch.randn(T, 32), None, fb)
        runtime.reset_extend_rows()
        # the fallback without the scheduler's record (a forward outside run_batch) still
        # feeds by row, as before
        fb = one_request_extend(r, 0, T, host_lens=True)
        with pytest.raises(AssertionError, match="fed"):
            observe_extend(backend, torch.randn(T, hq * d), attn, fb)
    finally:
        OBSERVING.clear()
        HIDDEN_OBSERVING.clear()
    steps.finish(r)


def test_a_windowed_keep_mask_evicts_within_its_window():
    """A decode-time plan's ``keep_mask`` covers positions ``keep_start ..`` only: a slot
    goes where no (layer, head) keeps its position there, nothing outside the window."""
    from agentkv.methods.base import Plan

    keep = torch.ones(2, 2, 6, dtype=torch.bool)
    keep[:, :, 1] = False  # position 11: gone in every column
    keep[0, 0, 4] = False  # position 14: kept by three columns
    plan = Plan(keep_mask=keep, keep_start=10, evict=torch.tensor([2]))
    assert evicted_positions(plan, 20).tolist() == [2, 11]
    assert evicted_positions(plan, 12).tolist() == [2, 11]  # (a window past the row's end)
