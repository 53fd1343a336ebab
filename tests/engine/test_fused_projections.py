"""The engine's stacked projections (:mod:`agentkv.engine.fused_projections`): one GEMM for
a layer's q/k/v and one for its gate/up, whose weights stay the modules' own (views, no
memory added), with the same logits (on the CPU through Triton's interpreter, where the
tests let it run)."""

from __future__ import annotations

import copy
import importlib
import inspect
import re

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine import fused_projections  # noqa: E402
from agentkv.engine.fused_projections import StackedLinear, fuse_projections  # noqa: E402
from agentkv.kernels.backend import triton_interpreting  # noqa: E402


def _linears(lm, ids) -> int:
    """How many ``aten::linear`` calls one forward of ``lm`` over ``ids`` makes."""
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, torch.inference_mode():
        lm(ids)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::linear")


def test_the_fusable_classes_call_their_projections_as_the_stacking_expects():
    """Each MLP computes ``down(act(gate(x)) * up(x))`` and each attention ``forward``
    projects its ``hidden_states`` through q, k, v in that order (a test of the installed
    transformers: an upgrade that changes one fails here)."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    mlp = inspect.getsource(llama.LlamaMLP.forward)
    for names, suffix in ((fused_projections.MLP_FUSABLE, "MLP"),
                          (fused_projections.QKV_FUSABLE, "Attention")):  # fmt: skip
        for name in names:
            family = name.removesuffix(suffix).lower().replace("moe", "_moe")
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            forward = inspect.getsource(getattr(module, name).forward)
            if suffix == "MLP":
                assert forward == mlp, name
                continue
            calls = re.findall(r"self\.([qkv])_proj\((\w+)\)", forward)
            assert calls == [("q", "hidden_states"), ("k", "hidden_states"),
                             ("v", "hidden_states")], name  # fmt: skip


def test_a_cpu_model_is_left_as_loaded(hf_model):
    lm = copy.deepcopy(hf_model)
    before = {n: p.data_ptr() for n, p in lm.named_parameters()}
    assert fuse_projections(lm) == 0
    assert {n: p.data_ptr() for n, p in lm.named_parameters()} == before


def test_stacked_layers_compute_the_same_logits_with_fewer_gemms(hf_model, monkeypatch):
    if not triton_interpreting():
        pytest.skip("the activation kernel runs on the CPU under TRITON_INTERPRET=1")
    lm = copy.deepcopy(hf_model)
    L = lm.config.num_hidden_layers
    ids = torch.tensor([[1, 9, 42, 7, 300, 5]])
    with torch.inference_mode():
        want = lm(ids).logits
    assert _linears(lm, ids) == 7 * L + 1  # (q k v o gate up down, the head)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    params, total = len(list(lm.parameters())), sum(p.numel() for p in lm.parameters())
    monkeypatch.setattr(fused_projections.PATH, "devices", frozenset({"cpu"}))
    assert fuse_projections(lm) == 2 * L
    assert fuse_projections(lm) == 2 * L  # (again: nothing stacked twice)
    # the same parameters, values and memory: each projection's weight a view of its stack
    assert len(list(lm.parameters())) == params
    assert sum(p.numel() for p in lm.parameters()) == total
    assert all(torch.equal(v, state[k]) for k, v in lm.state_dict().items())
    attn, mlp = lm.model.layers[0].self_attn, lm.model.layers[0].mlp
    stacked = attn._agentkv_stacked
    assert attn.k_proj.weight.untyped_storage().data_ptr() == stacked.weight.data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp._agentkv_stacked.weight.data_ptr()

    assert _linears(lm, ids) == 4 * L + 1  # (qkv o gate_up down, the head)
    with torch.inference_mode():
        got = lm(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # a projection called on its own input is its own GEMM, and under autograd all are
    x = torch.randn(2, lm.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(attn.k_proj(x), x @ attn.k_proj.weight.T, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():
        assert lm(ids).logits.requires_grad
    # a weight given new storage (as model.to() does) ends the stacking: unfused, still right
    attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight.detach().clone())
    assert not stacked.intact()
    assert _linears(lm, ids) == 4 * L + 1 + 2  # (layer 0's attention: q, k, v apart)
    with torch.inference_mode():
        torch.testing.assert_close(lm(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_each_thread_is_handed_its_own_k_and_v(monkeypatch):
    """``q_proj`` hands ``k_proj``/``v_proj`` their slices per thread: a second thread's
    ``q_proj`` between a thread's ``q_proj`` and its ``k_proj`` (forwards of one model in two
    threads) neither gives it the other's slices nor makes it recompute its own."""
    import threading

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    monkeypatch.setattr(fused_projections.PATH, "devices", frozenset({"cpu"}))
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    attn = LlamaAttention(cfg, layer_idx=0)
    assert fuse_projections(attn) == 1
    total = sum(attn._agentkv_stacked.sizes)
    xs = [torch.randn(1, 3, 64), torch.randn(1, 5, 64)]
    q_done, b_done = threading.Event(), threading.Event()
    got = {}

    def first() -> None:
        with torch.inference_mode():
            attn.q_proj(xs[0])
            q_done.set()
            b_done.wait(10)  # (the other thread's q_proj runs here)
            got[0] = attn.k_proj(xs[0]), attn.v_proj(xs[0])

    def second() -> None:
        q_done.wait(10)
        with torch.inference_mode():
            attn.q_proj(xs[1])
            b_done.set()
            got[1] = attn.k_proj(xs[1]), attn.v_proj(xs[1])

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(xs):
        for out, proj in zip(got[i], (attn.k_proj, attn.v_proj), strict=True):
            torch.testing.assert_close(out, x @ proj.weight.T)
            assert out.stride(-2) == total  # (a slice of the stacked GEMM: handed)


def test_stacking_refuses_projections_that_cannot_share_a_gemm():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 6, bias=False)
    assert StackedLinear.stack((a, b)) is None  # (a bias on one only)
    assert StackedLinear.stack((a, torch.nn.Linear(7, 4))) is None  # (another width)
    c = torch.nn.Linear(8, 6).to(torch.float64)
    assert StackedLinear.stack((a, c)) is None  # (another dtype)
    d = torch.nn.Linear(8, 6)
    x = torch.randn(3, 8)
    want = (a(x), d(x))
    s = StackedLinear.stack((a, d))
    assert s is not None and s.sizes == (4, 6) and s.intact()
    for got, w in zip(s(x), want, strict=True):
        torch.testing.assert_close(got, w)


def test_on_the_gpu_the_stacked_model_decodes_the_same_logits(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("the stacked projections run on CUDA")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(  # (q/k/v with bias, as Qwen2 has)
        hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    for m in lm.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.normal_(m.bias, 0, 0.5)
    ids = torch.randint(0, 1000, (1, 17), device="cuda")
    with torch.inference_mode():
        want = lm(ids).logits.float()
    assert fuse_projections(lm) == 4
    assert _linears(lm, ids) == 4 * 2 + 1
    with torch.inference_mode():
        got = lm(ids).logits.float()
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
