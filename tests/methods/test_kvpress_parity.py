"""Peer parity: SnapKV, StreamingLLM and H2O keep exactly the cells kvpress 0.5.5's presses
keep, on the real default model and a real tau-bench context.

kvpress is installed from PyPI with ``--no-deps`` (``make setup``). Its package ``__init__``
imports every press, some of which need ``datasets`` / ``peft``; the three press modules
used here need only torch and transformers, so they are loaded without it. kvpress 0.5.5
pins transformers < 5.3, whose layers still received ``cache_position``: it is passed to the
model explicitly here, which is all its hooks need from newer transformers.

Each press runs inside one eager-attention prefill of the HF model (kvpress's own way); the
cells it kept are identified by matching its compressed keys against the uncompressed ones
(bit-identical: the same forward computed them). The engine runs the same policy on the same
token ids through :meth:`Engine.compress`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def presses() -> types.SimpleNamespace:
    spec = importlib.util.find_spec("kvpress")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("kvpress is not installed (make setup installs kvpress==0.5.5 --no-deps)")
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {k: v for k, v in sys.modules.items() if k == "kvpress" or k.startswith("kvpress.")}
    for name, path in (("kvpress", root), ("kvpress.presses", root / "presses")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    try:
        from kvpress.presses.observed_attention_press import ObservedAttentionPress
        from kvpress.presses.snapkv_press import SnapKVPress
        from kvpress.presses.streaming_llm_press import StreamingLLMPress
    finally:
        for k in [k for k in sys.modules if k == "kvpress" or k.startswith("kvpress.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return types.SimpleNamespace(
        snapkv=SnapKVPress, streaming=StreamingLLMPress, observed=ObservedAttentionPress
    )


@pytest.fixture(scope="module")
def eager_model():
    from transformers import AutoModelForCausalLM

    from agentkv.engine.model_loader import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(None), attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def context_ids(engine) -> list[int]:
    """~240 tokens of a real tau-bench conversation (user, assistant and tool turns)."""
    from agentkv.bench.traces import load_tau_bench

    msgs = load_tau_bench()[0].messages
    text = " ".join(str(m.get("content") or "") for m in msgs[1:6])[:1500]
    return engine.tokenizer(text)["input_ids"]


def prefill_keys(model, ids: list[int], press=None) -> list[torch.Tensor]:
    """Per layer ``[Hkv, T | n, D]``: the keys one prefill of ``ids`` leaves in the cache
    (all ``T`` without a press; the ``n`` that ``press`` kept with one)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else contextlib.nullcontext():
        model(torch.tensor([ids]), past_key_values=cache, cache_position=torch.arange(len(ids)))
    return [layer.keys[0] for layer in cache.layers]


@pytest.fixture(scope="module")
def full_keys(eager_model, context_ids) -> list[torch.Tensor]:
    """The uncompressed prefill's keys, computed once for every press and budget."""
    return prefill_keys(eager_model, context_ids)


def kvpress_kept(model, press, ids: list[int], full: list[torch.Tensor]) -> torch.Tensor:
    """bool ``[L, Hkv, T]``: the cells ``press`` keeps in one prefill of ``ids``, found among
    ``full`` (:func:`full_keys`: the same forward without the press computes them)."""
    pressed = prefill_keys(model, ids, press)
    n_layers, n_heads = len(full), full[0].shape[0]
    kept = torch.zeros(n_layers, n_heads, len(ids), dtype=torch.bool)
    for layer in range(n_layers):
        fk, ck = full[layer], pressed[layer]  # [H, T|n, D]
        for h in range(n_heads):
            diff = (ck[h][:, None, :] - fk[h][None]).abs().amax(-1)  # [n, T]
            assert float(diff.min(-1).values.max()) == 0.0  # each kept key is one of the T
            kept[layer, h, diff.argmin(-1)] = True
    return kept


@pytest.mark.parametrize("budget", [64, 160])
@pytest.mark.parametrize(
    ("name", "press_of", "policy_of"),
    [
        (
            "snapkv",
            lambda p, r: p.snapkv(compression_ratio=r, window_size=16, kernel_size=5),
            lambda n: f"snapkv:budget={n},window=16,kernel=5",
        ),
        (
            "streamingllm",
            lambda p, r: p.streaming(compression_ratio=r, n_sink=4),
            lambda n: f"streamingllm:budget={n},sinks=4",
        ),
        (
            "h2o",  # kvpress's H2O: ObservedAttentionPress (no recent window)
            lambda p, r: p.observed(compression_ratio=r),
            lambda n: f"h2o:budget={n},recent=0",
        ),
    ],
)
def test_same_cells_as_kvpress(
    engine, eager_model, presses, context_ids, full_keys, budget, name, press_of, policy_of
):
    T = len(context_ids)
    assert budget + 64 < T  # the press must evict
    press = press_of(presses, 1 - budget / T)
    theirs = kvpress_kept(eager_model, press, context_ids, full_keys)
    n_kept = int(theirs[0, 0].sum())
    assert (theirs.sum(-1) == n_kept).all()  # kvpress keeps n per (layer, head)
    ours = engine.compress(context_ids, policy_of(n_kept)).kept
    assert ours.shape == theirs.shape
    assert torch.equal(ours, theirs), (
        f"{name}: {(ours != theirs).sum().item()} of {ours.numel()} cells differ"
    )
