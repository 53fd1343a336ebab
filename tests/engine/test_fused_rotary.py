"""The engine's rotary embedding in one kernel (:mod:`agentkv.engine.fused_rotary`): the
default model's attention layers call it, and it computes transformers' rotation bit for
bit (on the CPU through Triton's interpreter, where the tests let it run)."""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine import fused_rotary  # noqa: E402
from agentkv.engine.fused_rotary import fuse_rotary  # noqa: E402
from agentkv.kernels.backend import triton_interpreting  # noqa: E402


def test_the_fusable_classes_rotate_with_the_function_the_kernel_reproduces():
    """Each class's module holds transformers' Llama ``apply_rotary_pos_emb`` and its
    ``forward`` calls it by that name: an upgrade that changes one fails here."""
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    ref = inspect.getsource(inspect.unwrap(llama.apply_rotary_pos_emb))
    for name in fused_rotary.FUSABLE:
        family = name.removesuffix("Attention").lower().replace("moe", "_moe")
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert inspect.getsource(inspect.unwrap(module.apply_rotary_pos_emb)) == ref, name
        assert inspect.getsource(module.rotate_half) == inspect.getsource(llama.rotate_half)
        forward = inspect.getsource(getattr(module, name).forward)
        assert "= apply_rotary_pos_emb(query_states, key_states, cos, sin)" in forward, name


def test_the_model_rotates_through_the_kernel_and_its_logits_are_unchanged(hf_model, monkeypatch):
    if not triton_interpreting():
        pytest.skip("the kernel runs on the CPU under TRITON_INTERPRET=1")
    lm = copy.deepcopy(hf_model)
    ids = torch.tensor([[1, 9, 42, 7, 300, 5]])
    with torch.inference_mode():
        want = lm(ids).logits
    calls = []
    kernel = fused_rotary.apply_rotary
    monkeypatch.setattr(
        fused_rotary, "apply_rotary", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    assert fuse_rotary(lm) == lm.config.num_hidden_layers
    with torch.inference_mode():
        assert torch.equal(lm(ids).logits, want) and not calls  # (CPU inputs: transformers')
    monkeypatch.setattr(fused_rotary.PATH, "devices", frozenset({"cpu"}))
    with torch.inference_mode():
        got = lm(ids).logits
    assert len(calls) == lm.config.num_hidden_layers  # (every layer through the kernel)
    assert torch.equal(got, want)  # (bit for bit: the kernel rounds where transformers does)
    assert fuse_rotary(lm) == lm.config.num_hidden_layers  # (again: nothing wrapped twice)
    with torch.inference_mode():
        lm(ids)
    assert len(calls) == 2 * lm.config.num_hidden_layers
    calls.clear()
    lm(ids)  # (under autograd: transformers' own, the kernel has no backward)
    assert not calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_gpu_a_16_bit_model_rotates_bit_for_bit(dtype, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("the fused rotation runs on CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 1000, (2, 33), device="cuda")
    pos = torch.arange(4000, 4033, device="cuda")[None].expand(2, -1)  # (large angles)
    with torch.inference_mode():
        want = lm(ids, position_ids=pos).logits
        assert fuse_rotary(lm) == 2
        calls = []
        kernel = fused_rotary.apply_rotary
        monkeypatch.setattr(
            fused_rotary, "apply_rotary", lambda *a, **k: calls.append(1) or kernel(*a, **k)
        )
        got = lm(ids, position_ids=pos).logits
    assert len(calls) == 2 and torch.equal(got, want)
