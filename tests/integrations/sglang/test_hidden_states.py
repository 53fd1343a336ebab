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


def hf_layer_inputs(hf, ids: list[int]) -> torch.Tensor:
    """``[L, T, D_h]``: the input of every decoder layer over the whole prompt, alone."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
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


def extend(sgl, steps, reqs, ranges):
    """One SGLang extend forward: request ``i`` computes positions ``ranges[i]`` of its row."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    ids, pos, locs, lens, prefix = [], [], [], [], []
    for r, (a, b) in zip(reqs, ranges, strict=True):
        ids += r.origin_input_ids[a:b]
        pos.append(torch.arange(a, b))
        locs.append(steps.row(r)[a:b])
        lens.append(b - a)
        prefix.append(a)
    n = sum(lens)
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
    runner = SimpleNamespace(device="cpu", req_to_token_pool=steps.r2t, token_to_kv_pool=steps.kv)
    backend = TorchNativeAttnBackend(runner)
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    fields = {f.name for f in dataclasses.fields(ForwardContext)}
    ctx = ForwardContext(**{k: v for k, v in {"attn_backend": backend}.items() if k in fields})
    with torch.no_grad(), forward_context(ctx):
        out = sgl.model(fb.input_ids, fb.positions, fb)
    assert out.shape == (n, LLAMA_CONFIG["hidden_size"])


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
        assert "decode_interval=16 ignored on SGLang" in state.usage["plan_note"]
        assert state.usage["live_kv_tokens"] == T - n
        evicted[name] = n
    assert evicted["a"] > 0 and evicted["a"] < 24 - window
    assert steps.alloc.available_size() == free_before + evicted["a"] + evicted["b"]
    assert not HIDDEN_OBSERVING and not OBSERVING
    for r in (a, b):
        steps.finish(r)
    steps.cache.check_invariants()


def test_hook_skips_decode_and_unobserved_batches():
    """Decode batches (CUDA-graph capture included) and batches without a KVzap request never
    reach an observer."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from agentkv.integrations.sglang.hidden_states import observe_layer_input

    class Boom(PrefillObserver):
        def observe_hidden(self, layer, hidden, positions):
            raise AssertionError("observed")

    state = SimpleNamespace(observer=Boom())
    fb = SimpleNamespace(
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=torch.tensor([3]),
        extend_start_loc=torch.tensor([0]),
        extend_seq_lens=torch.tensor([1]),
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
