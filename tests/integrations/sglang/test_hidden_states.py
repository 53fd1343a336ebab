"""KVzap on SGLang: each decoder layer's input hidden state, taken by the plugin's pre-hooks on
SGLang's real tiny Llama (``LlamaForCausalLM``, real ``LlamaDecoderLayer``s with their fused
residual add, SGLang's ``TorchNativeAttnBackend`` on CPU) in a real extend ``ForwardBatch`` of
two requests, one with a cached prefix, equals the layer inputs transformers' Llama computes
for each request alone (the embedded engine's hook point); the request's KVzap observer
scores them, and the plan lands on its ``req_to_token`` row (slots freed, DEAD redirected)."""

from __future__ import annotations

import dataclasses
import socket
from types import SimpleNamespace

import pytest
import torch

from agentkv.integrations.sglang.hidden_states import (
    HIDDEN_DECODING,
    HIDDEN_OBSERVING,
    install_hidden_state_hooks,
)
from agentkv.integrations.sglang.request_plan import HOLEY, check_payload, request_state
from agentkv.integrations.sglang.runtime import OBSERVING, before_extend, plan_one
from agentkv.methods.base import PrefillObserver
from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta
from agentkv.policies import KVzap
from agentkv.wire import KVPayload, encode_payload

#: the tiny shape of conftest's pools (2 layers, 4 query / 2 KV heads of dim 8), as a Llama.
LLAMA_CONFIG = {
    "head_dim": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "tie_word_embeddings": True,
    "vocab_size": 256,
}


@pytest.fixture(autouse=True)
def empty_tables():
    """The scheduler process's observer tables, empty before and after each test."""
    for t in (HIDDEN_OBSERVING, HIDDEN_DECODING, OBSERVING):
        t.clear()
    yield
    for t in (HIDDEN_OBSERVING, HIDDEN_DECODING, OBSERVING):
        t.clear()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, model_dir):
    """SGLang's and transformers' tiny Llama / Qwen3 with the same weights (TP = 1 on gloo)."""
    import transformers
    from sglang.srt.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(1)
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.server_args import ServerArgs

    initialize_dp_attention(  # Qwen3's LayerCommunicator reads it (no DP attention here)
        ServerArgs(model_path=str(model_dir), page_size=1, device="cpu"),
        SimpleNamespace(hf_config=SimpleNamespace(), hidden_size=32, dtype=torch.float32),
    )
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    if request.param == "llama":
        cfg, hf_cls, sgl_cls = (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            LlamaForCausalLM,
        )
    else:
        cfg, hf_cls, sgl_cls = (
            transformers.Qwen3Config,
            transformers.Qwen3ForCausalLM,
            Qwen3ForCausalLM,
        )
    cfg = cfg(**LLAMA_CONFIG)
    torch.manual_seed(0)
    hf = hf_cls(cfg).eval()
    hf.config._attn_implementation = "eager"  # masked rows stay finite
    # SGLang's CPU rope path (the CUDA-less fallback otherwise imports vLLM's kernel)
    was, rope._is_cpu = rope._is_cpu, True
    try:
        sgl = sgl_cls(cfg)
    finally:
        rope._is_cpu = was
    sgl.load_weights(list(hf.state_dict().items()))
    assert install_hidden_state_hooks(sgl) == cfg.num_hidden_layers
    assert install_hidden_state_hooks(sgl) == 0  # once per model
    return sgl, hf


def hf_layer_inputs(hf, ids: list[int], dead: list[int] | None = None) -> torch.Tensor:
    """``[L, T, D_h]``: the input of every decoder layer over the whole prompt, alone;
    positions ``dead`` masked out as keys (for rows computed after they were evicted)."""
    mask = torch.ones(1, len(ids), dtype=torch.long)
    if dead:
        mask[0, dead] = 0
    with torch.no_grad():
        out = hf(torch.tensor([ids]), attention_mask=mask, output_hidden_states=True)
    return torch.stack(out.hidden_states[: hf.config.num_hidden_layers])[:, 0]


class Tee(PrefillObserver):
    """Records what the hooks hand a request, and passes it on to its KVzap observer."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def observe(self, *args):
        self.inner.observe(*args)

    def observe_hidden(self, layer, hidden, positions):
        self.seen.setdefault(layer, []).append((hidden.clone(), positions.clone()))
        self.inner.observe_hidden(layer, hidden, positions)

    def result(self):
        return self.inner.result()


def extend(sgl, steps, reqs, ranges, backend=None):
    """One SGLang extend forward: request ``i`` computes positions ``ranges[i]`` of its row."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    ids, pos, locs, lens, prefix = [], [], [], [], []
    for r, (a, b) in zip(reqs, ranges, strict=True):
        ids += r.origin_input_ids[a:b]
        pos.append(torch.arange(a, b))
        locs.append(steps.row(r)[a:b])
        lens.append(b - a)
        prefix.append(a)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(reqs),
        input_ids=torch.tensor(ids),
        req_pool_indices=torch.tensor([r.req_pool_idx for r in reqs]),
        seq_lens=torch.tensor([b for _, b in ranges]),
        out_cache_loc=torch.cat(locs),
        seq_lens_sum=sum(b for _, b in ranges),
        positions=torch.cat(pos),
        extend_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]),
        extend_seq_lens=torch.tensor(lens),
        extend_prefix_lens=torch.tensor(prefix),
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=lens,
    )
    if backend is None:
        runner = SimpleNamespace(
            device="cpu", req_to_token_pool=steps.r2t, token_to_kv_pool=steps.kv
        )
        backend = TorchNativeAttnBackend(runner)
    run_forward(sgl, fb, backend)


def run_forward(sgl, fb, backend):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    fields = {f.name for f in dataclasses.fields(ForwardContext)}
    ctx = ForwardContext(**{k: v for k, v in {"attn_backend": backend}.items() if k in fields})
    with torch.no_grad(), forward_context(ctx):
        out = sgl.model(fb.input_ids, fb.positions, fb)
    assert out.shape == (fb.input_ids.numel(), LLAMA_CONFIG["hidden_size"])


def write_surrogate(folder, shape, hidden_size: int) -> Surrogate:
    """A linear surrogate for the tiny shape; every head and layer reads one direction, so
    scores agree enough across (layer, head) for whole positions to go."""
    L, hkv = shape.num_layers, shape.num_kv_heads
    meta = SurrogateMeta(
        "tiny-llama", "linear", L, shape.num_q_heads, hkv, shape.head_dim, hidden_size
    )
    g = torch.Generator().manual_seed(1)
    v = torch.randn(hidden_size, generator=g)
    sur = Surrogate(meta, v.expand(L, hkv, hidden_size).contiguous(), torch.zeros(L, hkv))
    sur.save(folder / "linear.safetensors")
    return Surrogate.load(folder / "linear.safetensors")  # as the method reads it (fp16 file)


def test_kvzap_layer_inputs_from_a_real_sglang_batch_and_the_plan(models, steps, tmp_path):
    sgl, hf = models
    shape = steps.planner.shape
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 8)
    sur = write_surrogate(tmp_path, shape, LLAMA_CONFIG["hidden_size"])
    g = torch.Generator().manual_seed(7)
    ids_a = torch.randint(1, 256, (24,), generator=g).tolist()
    ids_b = torch.randint(1, 256, (20,), generator=g).tolist()
    want_h = {"a": hf_layer_inputs(hf, ids_a), "b": hf_layer_inputs(hf, ids_b)}
    want_s = {k: torch.stack([sur.score(i, h[i]).T for i in range(2)]) for k, h in want_h.items()}
    # the threshold splits a's prunable positions: some whole positions go, some stay
    window = 4
    best = want_s["a"][:, :, : 24 - window].amax(dim=(0, 1))
    threshold = float(best.median())
    policy = KVzap(threshold=threshold, window=window, surrogate="linear",
                   surrogate_path=str(tmp_path))  # fmt: skip
    payload = encode_payload(KVPayload(session_id="kvzap-a", policy=policy))
    assert check_payload(payload).policy.method == "kvzap"  # served, no 400 any more
    a = steps.request(ids_a, payload, rid="a")
    b = steps.request(
        ids_b,
        encode_payload(KVPayload(session_id="kvzap-b", policy=policy)),
        rid="b",
    )
    steps.prefill(a, plan=False)  # rows and slots (the KV is written by the forwards below)
    steps.prefill(b, plan=False)
    HOLEY.dead_slot = steps.alloc.dead_slot
    import agentkv.integrations.sglang.runtime as runtime

    runtime._PLANNER = steps.planner
    # b's first 8 positions: a prefix computed by an earlier batch (not observed)
    extend(sgl, steps, [b], [(0, 8)])
    a.prefix_indices = steps.row(a)[:0]
    b.prefix_indices = steps.row(b)[:8]
    sched = SimpleNamespace(
        token_to_kv_pool_allocator=steps.alloc,
        model_config=SimpleNamespace(num_attention_heads=shape.num_q_heads),
        tp_size=1,
    )
    for r in (a, b):
        request_state(r).planned = False
    before_extend(sched, SimpleNamespace(reqs=[a, b]))
    assert set(HIDDEN_OBSERVING) == {a.req_pool_idx, b.req_pool_idx} and not OBSERVING
    tees = {}
    for name, r in (("a", a), ("b", b)):
        state = request_state(r)
        tees[name] = state.observer = Tee(state.observer)
    extend(sgl, steps, [a, b], [(0, 24), (8, 20)])

    # the hooks' rows: each request's own, every layer, equal to its layer inputs alone
    for name, (lo, hi) in (("a", (0, 24)), ("b", (8, 20))):
        seen = tees[name].seen
        assert sorted(seen) == [0, 1]
        for layer in (0, 1):
            [(h, p)] = seen[layer]
            assert torch.equal(p, torch.arange(lo, hi))
            torch.testing.assert_close(h, want_h[name][layer, lo:hi], atol=2e-5, rtol=1e-4)
        # the KVzap buffer: scores of the computed positions; the prefix unscored (kept)
        got = tees[name].inner.window_scores(0, hi)
        torch.testing.assert_close(got[:, :, lo:], want_s[name][:, :, lo:hi], atol=1e-4, rtol=1e-4)
        assert torch.isinf(got[:, :, :lo]).all()

    free_before = steps.alloc.available_size()
    evicted = {}
    for name, r in (("a", a), ("b", b)):
        state = request_state(r)
        T = len(state.tags)
        n = plan_one(steps.planner, steps.r2t, steps.alloc, r, state)
        keep = want_s[name] >= threshold
        keep[:, :, T - window :] = True
        if name == "b":
            keep[:, :, :8] = True  # no score: kept
        want = torch.nonzero(~keep.any(dim=(0, 1))).reshape(-1)
        now = torch.nonzero(steps.row(r)[:T] == steps.alloc.dead_slot).reshape(-1)
        assert torch.equal(now, want) and n == want.numel()
        assert state.usage["plan_note"].endswith(f"kvzap: {T - (8 if name == 'b' else 0)}/{T} "
                                                 "positions scored")  # fmt: skip
        assert HIDDEN_DECODING[r.req_pool_idx].interval == 16  # it goes on scoring, decoding
        assert state.usage["live_kv_tokens"] == T - n
        evicted[name] = n
    assert evicted["a"] > 0 and evicted["a"] < 24 - window
    assert steps.alloc.available_size() == free_before + evicted["a"] + evicted["b"]
    assert not HIDDEN_OBSERVING and not OBSERVING
    for r in (a, b):
        steps.finish(r)
    assert not HIDDEN_DECODING
    steps.cache.check_invariants()


def test_hook_skips_unobserved_batches():
    """Batches without a watched request, and decode batches for a request watched only in
    prefill (CUDA-graph capture at start-up included), reach no observer."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from agentkv.integrations.sglang.hidden_states import observe_layer_input

    class Boom(PrefillObserver):
        def observe_hidden(self, layer, hidden, positions):
            raise AssertionError("observed")

    from agentkv.integrations.sglang.request_plan import AgentKVRequest, untagged
    from agentkv.policies import FullCache
    from agentkv.wire import KVPayload

    state = AgentKVRequest(
        KVPayload(session_id="s", policy=FullCache()), untagged(list(range(10))), False, None
    )
    state.observer = Boom()
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor([3]),
        extend_start_loc=torch.tensor([0]),
        extend_seq_lens=torch.tensor([1]),
        extend_prefix_lens=torch.tensor([9]),
        positions=torch.tensor([9]),
    )
    h = torch.zeros(1, 32)
    observe_layer_input(0, h, None, fb)  # nobody observed
    HIDDEN_OBSERVING[3] = state
    try:
        observe_layer_input(0, h, h, fb)  # decode
        fb.forward_mode = ForwardMode.EXTEND
        with pytest.raises(AssertionError, match="observed"):
            observe_layer_input(0, h, h, fb)
    finally:
        HIDDEN_OBSERVING.clear()


def plugin_backend(sgl, steps, tmp_path):
    """The plugin's ``AgentKVTritonBackend`` (DEAD compacted out of ``kv_indices``; SGLang's
    Triton kernels under ``TRITON_INTERPRET=1``), built by the registered factory, which
    also installs the decoder-layer hooks (already there: installed once)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    from agentkv.integrations.sglang.attention import create_agentkv_backend

    d = tmp_path / "model"
    d.mkdir()
    arch = type(sgl).__name__
    config = LLAMA_CONFIG | {"architectures": [arch], "model_type": arch[:-11].lower()}
    (d / "config.json").write_text(__import__("json").dumps(config))
    runner = SimpleNamespace(
        req_to_token_pool=steps.r2t,
        token_to_kv_pool=steps.kv,
        token_to_kv_pool_allocator=steps.alloc,
        sliding_window_size=None,
        model_config=ModelConfig(model_path=str(d)),
        server_args=ServerArgs(model_path=str(d), page_size=1, device="cpu"),
        device="cpu",
        gpu_id=0,
        page_size=1,
        is_draft_worker=False,
        model=sgl,
    )
    backend = create_agentkv_backend(runner)
    assert getattr(sgl, "_agentkv_hidden_hooks", False)
    return backend


def decode_step(sgl, steps, req, token: int, backend) -> None:
    """One eager decode step of ``req`` (SGLang's decode ForwardBatch: one row)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    steps.decode(req, [token])  # slot allocated, row written (the forward writes its KV)
    p = req.kv_committed_len - 1
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        input_ids=torch.tensor([token]),
        req_pool_indices=torch.tensor([req.req_pool_idx]),
        seq_lens=torch.tensor([p + 1]),
        seq_lens_cpu=torch.tensor([p + 1]),
        out_cache_loc=steps.row(req)[p : p + 1],
        seq_lens_sum=p + 1,
        positions=torch.tensor([p]),
    )
    run_forward(sgl, fb, backend)


def test_kvzap_prunes_while_decoding_eagerly(models, steps, tmp_path):
    """decode_interval on SGLang: eager decode steps (the plugin's Triton backend, holes
    compacted) hand the hooks one row each, equal to the layer inputs transformers computes
    with the evicted positions masked; every ``interval`` observed steps the decode plan
    lands on the row; a step replayed from a CUDA graph (no hook ran) is not counted."""
    from agentkv.integrations.sglang.decode_pruning import after_decode
    from agentkv.integrations.sglang.usage import kv_usage

    sgl, hf = models
    shape = steps.planner.shape
    sur = write_surrogate(tmp_path, shape, LLAMA_CONFIG["hidden_size"])
    g = torch.Generator().manual_seed(3)
    T, window, interval = 16, 4, 3
    ids = torch.randint(1, 256, (T,), generator=g).tolist()
    out = torch.randint(1, 256, (6,), generator=g).tolist()
    full = ids + out

    def scores(h):  # [L, Hkv, n]
        return torch.stack([sur.score(i, h[i]).T for i in range(shape.num_layers)])

    threshold = float(scores(hf_layer_inputs(hf, full))[:, :, : T + 2].amax(dim=(0, 1)).median())
    policy = KVzap(threshold=threshold, window=window, surrogate="linear",
                   surrogate_path=str(tmp_path), decode_interval=interval)  # fmt: skip
    c = steps.request(ids, encode_payload(KVPayload(session_id="dec", policy=policy)), rid="c")
    steps.prefill(c, plan=False)
    HOLEY.dead_slot = dead = steps.alloc.dead_slot
    import agentkv.integrations.sglang.runtime as runtime

    runtime._PLANNER = steps.planner
    c.prefix_indices = steps.row(c)[:0]
    sched = SimpleNamespace(
        token_to_kv_pool_allocator=steps.alloc,
        req_to_token_pool=steps.r2t,
        model_config=SimpleNamespace(num_attention_heads=shape.num_q_heads),
        tp_size=1,
    )
    state = request_state(c)
    state.planned = False
    before_extend(sched, SimpleNamespace(reqs=[c]))
    extend(sgl, steps, [c], [(0, T)])
    n0 = plan_one(steps.planner, steps.r2t, steps.alloc, c, state)
    assert set(HIDDEN_DECODING) == {c.req_pool_idx} and not HIDDEN_OBSERVING

    def dead_now() -> list[int]:
        return torch.nonzero(steps.row(c) == dead).reshape(-1).tolist()

    e0 = dead_now()
    assert len(e0) == n0 > 0
    backend = plugin_backend(sgl, steps, tmp_path)
    watch = HIDDEN_DECODING[c.req_pool_idx]
    tee = watch.observer = Tee(watch.observer)
    free0 = steps.alloc.available_size()
    masks, planned = [], []
    for j, t in enumerate(out):
        masks.append(dead_now())  # what this step's attention skips
        decode_step(sgl, steps, c, t, backend)
        before = dead_now()
        assert after_decode(sched, SimpleNamespace(reqs=[c]), shape) == len(dead_now()) - len(
            before
        )
        planned.append(dead_now())
        assert after_decode(sched, SimpleNamespace(reqs=[c]), shape) == 0  # graph replay
        assert watch.observed == j + 1
    assert watch.plans == 2

    # the hooks' decode rows: one per step, at its position, equal to transformers' with the
    # positions dead at that step masked out
    for layer in range(shape.num_layers):
        rows = tee.seen[layer]
        assert [int(p) for _, p in rows] == list(range(T, T + 6))
        for j, (h, _) in enumerate(rows):
            want = hf_layer_inputs(hf, full[: T + j + 1], masks[j])[layer, T + j]
            torch.testing.assert_close(h[0], want, atol=2e-5, rtol=1e-4)

    # the two decode plans: positions that left the window since the last pass, below the
    # threshold in every (layer, head); scores of decoded positions from their decode rows
    def want_gone(lo: int, hi: int) -> set[int]:
        gone = set()
        for p in range(lo, hi):
            h = hf_layer_inputs(hf, full[: p + 1], masks[p - T] if p >= T else None)[:, p]
            if bool((scores(h[:, None]) < threshold).all()):
                gone.add(p)
        return gone

    g1, g2 = want_gone(T - window, T + 3 - window), want_gone(T + 3 - window, T + 6 - window)
    assert set(planned[2]) - set(e0) == g1 and set(planned[5]) - set(planned[2]) == g2
    assert g1 and max(g2, default=0) >= T  # both plans evicted, the second a decoded row
    assert steps.alloc.available_size() == free0 - 6 + len(g1) + len(g2)

    u = kv_usage(c, state, steps.planner, completion=7)  # 6 forwarded + the last
    assert u["evicted_tokens"] == n0 + len(g1) + len(g2)
    assert u["live_kv_tokens"] == T - n0 + 6 - len(g1) - len(g2)
    f, live0 = 6, T - n0
    saved = len(g1) * (f - 3) + len(g2) * 0
    assert u["effective_kv_reads"] == f * live0 + f * (f + 1) // 2 - saved
    assert "6/6 steps observed" in u["plan_note"]
    steps.finish(c)
    assert not HIDDEN_DECODING
    steps.cache.check_invariants()
