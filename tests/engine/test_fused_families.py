"""Every model family the fusions take (:data:`agentkv.engine.fused_path.LLAMA_FAMILIES`), at a
tiny random shape, fused as the engine fuses on CUDA (norms, rotary, stacked projections; on
the CPU through Triton's interpreter, where the tests let them run): every op taken in every
layer, the same logits as transformers' own forward."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine import fused_norms, fused_projections, fused_rotary  # noqa: E402
from agentkv.engine.fused_path import LLAMA_FAMILIES  # noqa: E402
from agentkv.engine.model_loader import apply_fusions, fused_ops  # noqa: E402
from agentkv.kernels.backend import triton_interpreting  # noqa: E402

SHAPE = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 256,
}  # fmt: skip


#: per family: config extras, and the layers each op takes per decoder layer (norms: two a
#: layer, Qwen3's q/k norms two more; projections: q/k/v, and the dense MLP where there is
#: one: Qwen2-MoE's shared expert, none in Qwen3-MoE, whose experts are one 3-d module)
FAMILIES = {
    "Llama": ({}, 2, 2),
    "Mistral": ({}, 2, 2),
    "Qwen2": ({"attention_bias": True}, 2, 2),  # (q/k/v biases: stacked too)
    "Qwen2Moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64}, 2, 2),
    "Qwen3": ({}, 4, 2),
    "Qwen3Moe": ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}, 4, 1),
}  # fmt: skip


def _model(family: str):
    import importlib

    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    module = importlib.import_module(f"transformers.models.{family.lower().replace('moe', '_moe')}")
    cfg = config_cls(**SHAPE, **FAMILIES[family][0])
    torch.manual_seed(0)
    lm = getattr(module, f"{family}ForCausalLM")(cfg).eval()
    for p in lm.parameters():  # (away from the init's zeros and ones)
        torch.nn.init.normal_(p, 0.0, 0.2)
    return lm


def test_every_family_is_covered():
    assert set(FAMILIES) == set(LLAMA_FAMILIES)


@pytest.mark.parametrize("family", LLAMA_FAMILIES)
def test_each_family_fuses_every_layer_and_keeps_its_logits(family, monkeypatch):
    if not triton_interpreting():
        pytest.skip("the kernels run on the CPU under TRITON_INTERPRET=1")
    lm = _model(family)
    ids = torch.tensor([[3, 17, 99, 4, 60, 2, 11]])
    with torch.inference_mode():
        want = lm(ids).logits
    for mod in (fused_norms, fused_rotary, fused_projections):
        monkeypatch.setattr(mod.PATH, "devices", frozenset({"cpu"}))
    L = lm.config.num_hidden_layers
    _, norms, projections = FAMILIES[family]
    assert apply_fusions(lm) == {
        "norms": norms * L + 1,
        "rotary": L,
        "projections": projections * L,
    }
    assert fused_ops(lm) == ["norms", "projections", "rotary"]
    with torch.inference_mode():
        got = lm(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_with_every_switch_off_a_fused_gpu_model_is_transformers_bit_for_bit(family, monkeypatch):
    """What ``agentkv serve --no-fused-ops`` does on CUDA: the fused ops' switches off, a
    model the engine fused (stacked weights, dispatchers in place) computes transformers'
    own logits exactly, and names no fused op; switched on again it runs them all."""
    if not torch.cuda.is_available():
        pytest.skip("the fusions run on CUDA")
    from agentkv.engine.model_loader import fusion_paths

    lm = _model(family).to("cuda", torch.bfloat16)
    ids = torch.tensor([[3, 17, 99, 4, 60, 2, 11]], device="cuda")
    with torch.inference_mode():
        want = lm(ids).logits
    assert all(apply_fusions(lm).values())
    assert fused_ops(lm) == ["norms", "projections", "rotary"]
    with torch.inference_mode():
        fused = lm(ids).logits
    for path in fusion_paths().values():
        monkeypatch.setattr(path, "enabled", False)
    assert fused_ops(lm) == []
    with torch.inference_mode():
        got = lm(ids).logits
    assert torch.equal(got, want)
    torch.testing.assert_close(fused.float(), want.float(), rtol=0.05, atol=0.05)
