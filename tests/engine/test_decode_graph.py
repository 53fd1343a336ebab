"""The kernels' decode step replayed from a CUDA graph (:class:`DecodeGraph`).

On CUDA (skipped elsewhere): a random-weight model at a small shape, served by two engines on
the same weights, one replaying its decode steps from a graph, one eager, decodes the same
greedy tokens (random weights make greedy argmax sensitive to the smallest numerical change,
so equal tokens over 100+ steps mean the same computation) in every KV mode, with a capture
per decode-index epoch (the first step, then once per decode-time page) and every other step
replayed. A capture that fails falls back to eager steps, nothing lost. On the CPU: asking
for graphs where they cannot run is a clear error, and the epochs a capture is valid in span
decode-time pages as planned.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest

from agentkv import FullCache, UniformQuant, build_payload
from agentkv.engine.engine import GenerationConfig

torch = pytest.importorskip("torch")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

MSGS = [{"role": "user", "content": "Name the colours of the sea at dusk, then count them. " * 12}]


def _small_lm(config, device: str, dtype):
    """Random weights at a small shape the Triton kernels take (head_dim 64, GQA 4)."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 4, 512, 1024
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 8, 2, 64
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


@pytest.fixture(scope="module")
def gpu_lm():
    """``(model, tokenizer)`` on CUDA: the default model's config and tokenizer
    (``AGENTKV_TEST_MODEL_DIR`` where the default model is not installed), random weights."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    from transformers import AutoConfig, AutoTokenizer

    from agentkv.engine.model_loader import resolve_model_dir

    model_dir = os.environ.get("AGENTKV_TEST_MODEL_DIR") or resolve_model_dir(None)
    cfg = AutoConfig.from_pretrained(model_dir)
    return _small_lm(cfg, "cuda", torch.bfloat16), AutoTokenizer.from_pretrained(model_dir)


def _engines(gpu_lm):
    from agentkv.engine.engine import Engine

    lm, tok = gpu_lm
    kw = {"tokenizer": tok, "kv_slots": 4096, "decode_attention": "kernels"}
    return Engine(lm, cuda_graphs=True, **kw), Engine(lm, cuda_graphs=False, **kw)


@cuda
@pytest.mark.parametrize("slack", [32, 512])
@pytest.mark.parametrize(
    "policy",
    [FullCache(), UniformQuant(bits=4, residual=16), UniformQuant(bits=2, residual=16)],
    ids=["bf16", "int4", "int2"],
)
def test_graph_replay_decodes_what_eager_steps_decode(gpu_lm, policy, slack, monkeypatch):
    """``slack``: the plan's bound slack; at 32 every decode-time page starts an epoch (a
    capture), at 512 (the default) the request's pages fit the first epoch's bounds."""
    from agentkv.engine import kernel_decode

    monkeypatch.setattr(kernel_decode, "BOUND_SLACK", slack)
    graphed, eager = _engines(gpu_lm)
    assert graphed.decode_graph is not None and eager.decode_graph is None
    steps = 130
    gen = GenerationConfig(max_tokens=steps, ignore_eos=True)
    got = graphed.chat(MSGS, payload=build_payload(MSGS, policy, "g"), gen=gen)
    want = eager.chat(MSGS, payload=build_payload(MSGS, policy, "e"), gen=gen)
    assert got.token_ids == want.token_ids and len(got.token_ids) == steps
    g = graphed.decode_graph
    assert g.failed is None
    # one capture per epoch, and every other step replays: with a page every 32 steps and
    # a slack of 32, 3-5 epochs; else the one
    pages = got.usage.quantized_entries > 0 and slack == 32
    assert 3 <= g.captures <= 5 if pages else g.captures == 1
    assert g.replays == steps - 1 - g.captures
    assert got.usage.resident_kv_bytes == want.usage.resident_kv_bytes
    # a second request (its own index; the prompt maybe from the prefix cache) captures
    # again and decodes what the eager engine's second request decodes
    again = graphed.chat(MSGS, payload=build_payload(MSGS, policy, "g2"), gen=gen)
    want = eager.chat(MSGS, payload=build_payload(MSGS, policy, "e2"), gen=gen)
    assert again.token_ids == want.token_ids
    assert again.usage.prefix_hit_tokens == want.usage.prefix_hit_tokens


@cuda
def test_kvzap_pruning_while_decoding_replays_what_eager_steps_decode(gpu_lm, tmp_path):
    """KVzap prunes every 16 decode steps from its surrogate's scores of each step's layer
    inputs: replayed steps record those in its ring, and the graphed engine decodes and
    evicts what the eager one does. A pruning pass drops its cells from the index in place,
    so one capture serves the whole decode."""
    from agentkv import KVzap
    from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta

    lm, _ = gpu_lm
    meta = SurrogateMeta.for_config(lm.config, "random", "linear")
    L, H = meta.num_layers, meta.num_kv_heads
    g = torch.Generator().manual_seed(1)
    Surrogate(meta, torch.randn(L, H, meta.hidden_size, generator=g), torch.zeros(L, H)).save(
        tmp_path / "linear.safetensors"
    )
    policy = KVzap(threshold=0.0, window=16, surrogate="linear", surrogate_path=str(tmp_path))
    graphed, eager = _engines(gpu_lm)
    steps = 130
    gen = GenerationConfig(max_tokens=steps, ignore_eos=True)
    got = graphed.chat(MSGS, payload=build_payload(MSGS, policy, "g"), gen=gen)
    want = eager.chat(MSGS, payload=build_payload(MSGS, policy, "e"), gen=gen)
    assert got.token_ids == want.token_ids and len(got.token_ids) == steps
    assert got.usage.evicted_entries == want.usage.evicted_entries
    (obs,) = graphed.methods.for_policy(policy)._sessions.values()
    assert got.usage.evicted_entries > 0
    assert obs.pruned_until > got.usage.prompt_tokens + 64  # (decode-time passes pruned)
    g = graphed.decode_graph
    assert g.failed is None and g.replays == steps - 1 - g.captures
    assert g.captures == 1
    assert got.usage.resident_kv_bytes == want.usage.resident_kv_bytes
    assert obs._ring is None  # (freed with the decode)


def _same_usage(a, b) -> None:
    for field in ("resident_kv_bytes", "live_kv_tokens", "evicted_entries", "quantized_entries"):
        assert getattr(a.usage, field) == getattr(b.usage, field), field


@cuda
def test_steps_launched_ahead_end_where_steps_one_at_a_time_end(gpu_lm):
    """Graph steps launch before the host has read the token they feed (sampled on the
    device): a decode that ends on a stop token, a stop string or an abort undoes the step
    launched on it, so the request's tokens, KV and telemetry (and what the prefix cache
    keeps of it) are the one-step-at-a-time engine's, and the store stays consistent; a
    seeded sampled decode draws the same tokens graphed, ahead or not, and eager."""
    graphed, eager = _engines(gpu_lm)
    serial, _ = _engines(gpu_lm)
    serial.decode_overlap = False
    policy = UniformQuant(bits=4, residual=16)
    probe = eager.chat(
        MSGS,
        payload=build_payload(MSGS, policy, "probe"),
        gen=GenerationConfig(max_tokens=90, ignore_eos=True),
    )
    ids = probe.token_ids
    # a stop token first met 40+ steps in (past a decode-time page)
    stop_tok = next(t for i, t in enumerate(ids) if i >= 40 and t not in ids[:i])
    first = ids.index(stop_tok)
    text = graphed.tokenizer.decode(ids, skip_special_tokens=True)
    stop_str = text[len(graphed.tokenizer.decode(ids[:30], skip_special_tokens=True)) :][:6]
    cases = {
        "stop token": ({"max_tokens": 90}, {stop_tok}),
        "stop string": ({"max_tokens": 90, "ignore_eos": True, "stop": [stop_str]}, set()),
        "abort": ({"max_tokens": 90, "ignore_eos": True}, set()),
        "length": ({"max_tokens": 57, "ignore_eos": True}, set()),
        "sampled": ({"max_tokens": 70, "temperature": 0.8, "top_p": 0.9, "seed": 7}, set()),
    }
    for case, (kw, extra_stops) in cases.items():
        results = []
        for n, e in enumerate((graphed, serial, eager)):
            stops = e._stop_ids
            e._stop_ids = stops | extra_stops
            polls = iter(range(10**6))
            gen = GenerationConfig(
                **kw, should_stop=(lambda p=polls: next(p) >= 25) if case == "abort" else None
            )
            try:
                results.append(
                    e.chat(MSGS, payload=build_payload(MSGS, policy, f"{case}{n}"), gen=gen)
                )
            finally:
                e._stop_ids = stops
            e.store.check_invariants()
        got, one_at_a_time, want = results
        assert got.token_ids == one_at_a_time.token_ids == want.token_ids, case
        assert got.finish_reason == want.finish_reason, case
        _same_usage(got, want)
        _same_usage(one_at_a_time, want)
        if case == "stop token":  # (or an end of turn before it)
            end = next(i for i, t in enumerate(ids) if t in eager._stop_ids | {stop_tok})
            assert got.token_ids == ids[:end] and end <= first and got.finish_reason == "stop"
        if case == "abort":  # (the 26th poll: one before prefill, one a step)
            assert len(got.token_ids) == 24 and got.finish_reason == "abort"
    assert graphed.decode_graph.replays > 0 and graphed.decode_graph.failed is None
    # what each engine's prefix cache kept of those requests serves the next one alike
    again = [
        e.chat(MSGS, payload=build_payload(MSGS, FullCache(), f"again{n}"),
               gen=GenerationConfig(max_tokens=12, ignore_eos=True))
        for n, e in enumerate((graphed, eager))
    ]  # fmt: skip
    assert again[0].token_ids == again[1].token_ids
    assert again[0].usage.prefix_hit_tokens == again[1].usage.prefix_hit_tokens


@cuda
def test_a_pool_that_runs_out_mid_decode_ends_it_alike_ahead_or_not(gpu_lm):
    """Another request holds all but a few cells: the step launched ahead on a token not
    read yet finds no cell (its launch fails, nothing taken), the token it was fed is still
    the decode's next one, and the decode ends there ("length") with the tokens, telemetry
    and store of the engine that steps one at a time, and of the eager one."""
    graphed, eager = _engines(gpu_lm)
    serial, _ = _engines(gpu_lm)
    serial.decode_overlap = False
    policy = FullCache()  # (every decoded token takes a full-precision cell)
    gen = GenerationConfig(max_tokens=60, ignore_eos=True)
    prompt = eager.chat(MSGS, payload=build_payload(MSGS, policy, "p"), gen=gen)
    results = []
    for n, e in enumerate((graphed, serial, eager)):
        e.flush_prefix_cache()
        free = e.store.stats().free_slots
        blocker = e.store.begin_request(None, [7] * (free - prompt.usage.prompt_tokens - 6))
        e.store.extend(blocker)
        try:
            results.append(e.chat(MSGS, payload=build_payload(MSGS, policy, f"o{n}"), gen=gen))
        finally:
            e.store.finish_request(blocker, cache=False)
        e.store.check_invariants()
        e.flush_prefix_cache()
        stats = e.store.stats()
        assert stats.free_slots == stats.capacity  # (every cell back)
    got, one_at_a_time, want = results
    assert got.token_ids == one_at_a_time.token_ids == want.token_ids
    assert (
        1 <= len(want.token_ids) < 20 and want.token_ids == prompt.token_ids[: len(want.token_ids)]
    )
    assert got.finish_reason == one_at_a_time.finish_reason == want.finish_reason == "length"
    _same_usage(got, want)
    _same_usage(one_at_a_time, want)
    assert graphed.decode_graph.replays > 0 or graphed.decode_graph.captures > 0


@cuda
def test_a_capture_that_fails_leaves_the_decode_eager_and_whole(gpu_lm, caplog):
    graphed, eager = _engines(gpu_lm)
    g = graphed.decode_graph
    forward = g.forward
    capturing = []

    def syncing_forward(*args):  # a host sync: illegal while the stream is captured
        out = forward(*args)
        capturing.append(torch.cuda.is_current_stream_capturing())
        torch.cuda.synchronize()
        return out

    g.forward = syncing_forward
    gen = GenerationConfig(max_tokens=40, ignore_eos=True)
    policy = UniformQuant(bits=4, residual=8)
    got = graphed.chat(MSGS, payload=build_payload(MSGS, policy, "f"), gen=gen)
    want = eager.chat(MSGS, payload=build_payload(MSGS, policy, "e"), gen=gen)
    assert True in capturing  # (the capture was tried)
    assert g.failed is not None and g.captures == 0 and g.replays == 0
    assert "CUDA graph capture failed" in caplog.text
    from agentkv.engine.capabilities import capabilities  # (what a client sees)

    assert capabilities(graphed)["decode"] == {
        "attention": "kernels",
        "cuda_graphs": False,
        "graph_failure": g.failed,
        "steps_ahead": True,  # (eager steps from the device's token still launch ahead)
        "fused_ops": ["norms", "projections", "rotary"],
    }
    assert capabilities(eager)["decode"]["graph_failure"] is None
    assert not capabilities(eager)["decode"]["steps_ahead"]
    assert got.token_ids == want.token_ids
    # the failed engine's graph state goes (its memory pool freed: the allocator no longer
    # counts the failed capture, or it would abort the process here), and a new engine
    # captures and replays
    del graphed, g
    gc.collect()
    torch.cuda.synchronize()
    fresh, _ = _engines(gpu_lm)
    again = fresh.chat(MSGS, payload=build_payload(MSGS, policy, "f2"), gen=gen)
    assert fresh.decode_graph.captures >= 1 and fresh.decode_graph.replays > 0
    assert len(again.token_ids) == 40


@cuda
def test_only_the_kernels_steps_are_captured(gpu_lm):
    """An engine switched to another decode path after it was built (as benchmarks do)
    decodes that path eagerly: nothing captured, nothing marked failed."""
    graphed, _ = _engines(gpu_lm)
    gen = GenerationConfig(max_tokens=8, ignore_eos=True)
    for path in ("reference", "dense"):
        graphed.decode_attention = path
        res = graphed.chat(MSGS, payload=build_payload(MSGS, FullCache(), path), gen=gen)
        assert len(res.token_ids) == 8
    g = graphed.decode_graph
    assert g.captures == 0 and g.replays == 0 and g.failed is None


def test_graphs_where_they_cannot_run_are_refused(engine, hf_model):
    """On the CPU (or on the dense path) ``cuda_graphs=True`` is a ValueError; the default
    engine there has none."""
    from agentkv.engine.engine import Engine

    assert engine.decode_graph is None
    lm = _small_lm(hf_model.config, "cpu", torch.float32)
    with pytest.raises(ValueError, match="cuda_graphs needs decode_attention='kernels'"):
        Engine(lm, tokenizer=engine.tokenizer, cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        Engine(lm, tokenizer=engine.tokenizer, decode_attention="dense", cuda_graphs=True)


def test_a_captured_steps_epoch_spans_pages_until_a_bound_outgrows_its_slack():
    """What a captured step replays is valid within one ``KernelDecode.epoch``: the plan's
    bounds (``bounds``, the quantized segments' rounded up to ``BOUND_SLACK``) stay upper
    bounds of the index's through every followed decode-time page, the epoch changes only
    when the INT4 segment outgrows its slack, and a rebuild always starts a new one."""
    from cache.kv_fill import fill  # (tests/cache: K/V rows that say which token they hold)

    from agentkv.cache import KVStore, Precision
    from agentkv.engine.kernel_decode import BOUND_SLACK, KernelDecode

    L, H, D = 2, 2, 32
    st = KVStore(L, H, D, num_slots=2048)

    req = st.begin_request(None, [i % 50 + 1 for i in range(600)])
    fill(st, req, st.extend(req))
    p4 = int(Precision.INT4)
    st.set_precision(req, torch.full((448,), p4, dtype=torch.int8))
    kd = KernelDecode(st, req, room=200, backend="torch")
    assert BOUND_SLACK == 512 and kd.bounds.int4 == 512 and kd.bounds.int2 == 0
    epochs, start = [kd.epoch], 448
    for _ in range(4):  # 32 decode steps, then their page to INT4, followed in place
        for _step in range(32):
            cells = st.extend(req, [7])
            fill(st, req, cells)
            kd.append(cells)
        st.set_precision(req, torch.full((32,), p4, dtype=torch.int8), start=start)
        kd.rebuild((start, start + 32))
        start += 32
        ix, b = kd.index, kd.bounds
        assert int(ix.int4_lens.max()) == start  # (followed: every column's INT4 grew)
        assert b.int2 >= ix.max_lens.int2 and b.int4 >= ix.max_lens.int4 >= start
        assert b.full >= ix.max_lens.full and b.int4 % BOUND_SLACK == 0
        epochs.append(kd.epoch)
    # INT4 at 480, 512: the first epoch's bound holds; at 544, 576: one new epoch
    assert epochs == [epochs[0]] * 3 + [epochs[0] + 1] * 2
    assert kd.bounds.int4 == 1024
    st.finish_request(req, cache=False)


def _live_rows(ix) -> list[list[int]]:
    """Each column's live entries up to its length, in the order the kernels read them."""
    L, H, _ = ix.slot_map.shape
    lens = ix.seq_lens.reshape(-1).tolist()
    rows = ix.slot_map.reshape(L * H, -1)
    return [[e for e in rows[c, : lens[c]].tolist() if e != 0] for c in range(L * H)]


def test_an_eviction_while_decoding_keeps_the_index_buffers_and_the_epoch(monkeypatch):
    """KVzap evicts every few decode steps: the index drops the released cells in place (or,
    rebuilt, is refilled into the same buffers), reads what a new index reads, and the
    epoch stays while the bounds still cover it within twice the slack; past that the
    bounds are planned again (a new epoch), in the same buffers."""
    from cache.kv_fill import fill

    from agentkv.cache import DEAD, DecodeIndex, KVStore, Precision
    from agentkv.engine import kernel_decode
    from agentkv.engine.kernel_decode import KernelDecode

    L, H, D = 2, 2, 32
    st = KVStore(L, H, D, num_slots=2048)
    req = st.begin_request(None, [i % 50 + 1 for i in range(600)])
    fill(st, req, st.extend(req))
    prec = torch.full((320,), int(Precision.INT4), dtype=torch.int8)
    prec[:64] = int(Precision.INT2)  # (two INT2 pages per column)
    st.set_precision(req, prec)
    kd = KernelDecode(st, req, room=200, backend="torch")
    ix = kd.index
    ptrs = [t.data_ptr() for t in (ix.slot_map, ix.seq_lens, ix.int2_lens, ix.int4_lens)]
    epoch, bounds = kd.epoch, kd.bounds

    def decode(n: int) -> None:
        for _ in range(n):
            cells = st.extend(req, [7])
            fill(st, req, cells)
            kd.append(cells)

    def reads_as_a_new_index() -> None:
        new = DecodeIndex.build(req.slot_map, st.layout, kd.room - kd.appended, "cpu")
        assert _live_rows(kd.index) == _live_rows(new)
        assert torch.equal(kd.index.int4_lens, new.int4_lens)
        assert torch.equal(kd.index.int2_lens, new.int2_lens)  # (no page went whole)
        assert torch.equal(kd.index.seq_lens, new.seq_lens)
        b, m = kd.bounds, new.max_lens
        assert b.int2 >= m.int2 and b.int4 >= m.int4 and b.full >= m.full
        assert kd.index.longest >= new.longest

    decode(16)
    keep = torch.ones(L, H, 300, dtype=torch.bool)  # (positions 10 .. 309)
    keep[0, 1, 0:5] = False  # INT2 rows of one head (its page stays, those rows DEAD)
    keep[1, 0, 50:90] = False  # INT4 cells of another
    keep[1, 1, 290:300] = False  # full cells
    res = st.evict_per_head(req, keep, start=10)
    assert res.entries_evicted == 55 and res.released.shape == (L * H, 300)
    kd.rebuild(dropped=res.released)  # (a pruning pass: followed in place)
    now = [t.data_ptr() for t in (ix.slot_map, ix.seq_lens, ix.int2_lens, ix.int4_lens)]
    assert now == ptrs and kd.index is ix and kd.epoch == epoch and kd.bounds == bounds
    assert int((ix.slot_map[0, 1, :64] == DEAD).sum()) == 5
    reads_as_a_new_index()
    decode(16)  # (appends go on after the drop)
    reads_as_a_new_index()
    kd.rebuild(dropped=st.evict(req, torch.arange(400, 420)).released)
    reads_as_a_new_index()
    kd.rebuild()  # (a rebuild: refilled into the same buffers, the same epoch)
    assert kd.index is ix and ix.slot_map.data_ptr() == ptrs[0] and kd.epoch == epoch
    reads_as_a_new_index()
    # with a slack of 8, the rebuilt full segment's bound is loose by more than 16 now
    monkeypatch.setattr(kernel_decode, "BOUND_SLACK", 8)
    st.evict(req, torch.arange(450, 490))
    kd.rebuild()
    assert kd.epoch == epoch + 1 and kd.bounds != bounds and kd.index is ix
    reads_as_a_new_index()
    st.finish_request(req, cache=False)
