"""The engine's RMSNorm layers in one kernel on CUDA (:mod:`agentkv.engine.fused_norms`):
every norm of the default model is taken, the CPU path is the module's own, and on the GPU
the kernel computes what the module computes."""

from __future__ import annotations

import copy
import os

import pytest

torch = pytest.importorskip("torch")

from agentkv.engine import fused_norms  # noqa: E402
from agentkv.engine.fused_norms import fuse_rms_norms  # noqa: E402


def _norms(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def test_every_norm_of_the_model_is_taken_once_and_the_cpu_path_is_unchanged(hf_model):
    lm = copy.deepcopy(hf_model)
    norms = _norms(lm)
    L = lm.config.num_hidden_layers
    assert len(norms) == 2 * L + 1  # (two a layer and the final one)
    x = torch.randn(2, 5, lm.config.hidden_size)
    want = [n(x) for n in norms]
    assert fuse_rms_norms(lm) == len(norms)
    assert fuse_rms_norms(lm) == len(norms)  # (again: nothing wrapped twice)
    for n, w in zip(norms, want, strict=True):
        assert torch.equal(n(x), w)  # (a CPU input: the module's own forward)


def test_the_fusable_classes_compute_what_the_kernel_reproduces():
    """Each class taken runs exactly ``LlamaRMSNorm.forward`` (what ``rms_norm_ref``
    restates) in the installed transformers: an upgrade that changes one fails here."""
    import importlib
    import inspect

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from agentkv.kernels import rms_norm_ref

    ref = inspect.getsource(LlamaRMSNorm.forward)
    for name in fused_norms.FUSABLE:
        family = name.removesuffix("RMSNorm").lower().replace("moe", "_moe")
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert inspect.getsource(getattr(module, name).forward) == ref, name
    norm = LlamaRMSNorm(16, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 16).to(torch.bfloat16)
    assert torch.equal(norm.to(torch.bfloat16)(x), rms_norm_ref(x, norm.weight, 1e-5))


@pytest.fixture(scope="module")
def gpu_config():
    """The default model's config (``AGENTKV_TEST_MODEL_DIR`` where the model is not
    installed), for random weights on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("the fused norm runs on CUDA")
    from transformers import AutoConfig

    from agentkv.engine.model_loader import resolve_model_dir

    return AutoConfig.from_pretrained(
        os.environ.get("AGENTKV_TEST_MODEL_DIR") or resolve_model_dir(None)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_gpu_the_kernel_computes_what_the_module_does(gpu_config, dtype, monkeypatch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        lm = AutoModelForCausalLM.from_config(gpu_config, dtype=dtype)
    norms = _norms(lm)
    for n in norms:  # (weights other than ones)
        torch.nn.init.normal_(n.weight, 1.0, 0.1)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 1, lm.config.hidden_size, generator=g) * 4).to("cuda", dtype)
    calls = []
    kernel = fused_norms.rms_norm
    monkeypatch.setattr(fused_norms, "rms_norm", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.inference_mode():
        want = [n(x) for n in norms]
        assert fuse_rms_norms(lm) == len(norms)
        got_all = [n(x) for n in norms]
    assert len(calls) == len(norms)  # (every norm through the kernel)
    for got, w in zip(got_all, want, strict=True):
        assert got.dtype == w.dtype and got.shape == w.shape
        torch.testing.assert_close(got, w, rtol=1e-2, atol=1e-2)
        if dtype != torch.float32:  # (16-bit outputs: the float32 sum's order rarely shows)
            assert (got == w).float().mean() > 0.97
    monkeypatch.setattr(fused_norms.PATH, "enabled", False)  # (the switch: the module's own)
    with torch.inference_mode():
        assert all(torch.equal(n(x), w) for n, w in zip(norms, want, strict=True))
    assert len(calls) == len(norms)
