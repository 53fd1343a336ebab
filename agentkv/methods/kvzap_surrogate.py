"""KVzap surrogates: per-layer models from a layer's input hidden state to Hkv log-scores.

A surrogate predicts, for each position ``t`` and layer ``l``, ``log s+`` (the KVzip+ score,
see :mod:`agentkv.train.kvzip_targets`) of every KV head from the hidden state entering
layer ``l`` (the residual stream before ``input_layernorm``, size ``D_h``):

- ``linear``: ``h @ W.T + b``, ``W [Hkv, D_h]``;
- ``mlp``: ``GELU(h @ W1.T + b1) @ W2.T + b2``, ``W1 [D_h / 8, D_h]``, ``W2 [Hkv, D_h / 8]``
  (one hidden layer, as in the KVzap paper and kvpress).

Input standardisation is folded into the first layer at training time, so a surrogate is
plain weights. On disk: one safetensors file per kind (``linear.safetensors``,
``mlp.safetensors``) in a directory, the tensors stacked over layers (``w1 [L, H, D_h]``,
``b1 [L, H]``, and for the MLP ``w2 [L, Hkv, H]``, ``b2 [L, Hkv]``), float16, with the
model's shape in the safetensors metadata. ``agentkv train-kvzap`` writes such a directory;
the default model's surrogates ship in ``agentkv/methods/kvzap_surrogates/``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentkv.methods.base import ModelShape

KINDS = ("linear", "mlp")
#: shipped surrogates, one folder per model: ``<name>/{linear,mlp}.safetensors``.
SHIPPED_DIR = Path(__file__).resolve().parent / "kvzap_surrogates"
#: when set, ``KVzap(surrogate_path=...)`` must resolve inside this directory (a server that
#: takes policies from untrusted clients should set it).
ROOT_ENV = "AGENTKV_KVZAP_ROOT"
TRAIN_HINT = "agentkv train-kvzap --model MODEL_DIR --out DIR"
_MAX_FILE_BYTES = 1 << 30


class SurrogateNotFound(ValueError):
    """No usable surrogate for this model / path (the message names the command to make one);
    ``field`` names the policy field at fault (the engine's HTTP 400 names it)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SurrogateMeta:
    """What a surrogate was trained for (safetensors metadata)."""

    model: str
    kind: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    def matches(self, shape: ModelShape) -> bool:
        return (
            self.num_layers,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
        ) == (shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim)

    @classmethod
    def for_config(cls, config: Any, model: str, kind: str) -> SurrogateMeta:
        """For a surrogate of a HF model with this ``config`` (its layers, heads, head and
        hidden widths), named ``model``."""
        s = ModelShape.from_config(config)
        hidden = config.hidden_size
        return cls(model, kind, s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim, hidden)

    def to_metadata(self) -> dict[str, str]:
        return {"agentkv_kvzap": json.dumps(self.__dict__, sort_keys=True)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None) -> SurrogateMeta:
        raw = json.loads((meta or {})["agentkv_kvzap"])
        return cls(
            model=str(raw["model"]),
            kind=str(raw["kind"]),
            num_layers=int(raw["num_layers"]),
            num_q_heads=int(raw["num_q_heads"]),
            num_kv_heads=int(raw["num_kv_heads"]),
            head_dim=int(raw["head_dim"]),
            hidden_size=int(raw["hidden_size"]),
        )


class Surrogate:
    """Stacked per-layer weights; :meth:`score` runs one layer.

    Args:
        meta: what it was trained for.
        w1: ``[L, H1, D_h]`` (``H1 = Hkv`` for ``linear``); ``b1``: ``[L, H1]``.
        w2, b2: ``[L, Hkv, H1]``, ``[L, Hkv]`` for ``mlp``; None for ``linear``.
    """

    def __init__(
        self,
        meta: SurrogateMeta,
        w1: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ):
        self.meta = meta
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2
        self._cast: dict[tuple[torch.device, torch.dtype], list[torch.Tensor | None]] = {}

    @property
    def kind(self) -> str:
        return "linear" if self.w2 is None else "mlp"

    @property
    def num_params(self) -> int:
        return sum(t.numel() for t in (self.w1, self.b1, self.w2, self.b2) if t is not None)

    def _weights(self, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor | None]:
        key = (device, dtype)
        cast = self._cast.get(key)
        if cast is None:
            cast = self._cast[key] = [
                None if t is None else t.to(device=device, dtype=dtype)
                for t in (self.w1, self.b1, self.w2, self.b2)
            ]
        return cast

    def score(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted ``log s+``: ``hidden [n, D_h]`` (layer input) -> float32 ``[n, Hkv]``.

        Runs in the hidden state's dtype on its device (bf16 on GPU, float32 on CPU)."""
        w1, b1, w2, b2 = self._weights(hidden.device, hidden.dtype)
        assert w1 is not None and b1 is not None
        out = F.linear(hidden, w1[layer], b1[layer])
        if w2 is not None and b2 is not None:
            out = F.linear(F.gelu(out), w2[layer], b2[layer])
        return out.float()

    def score_all(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every layer at once: ``hidden [L, n, D_h]`` (layer ``l``'s inputs in row ``l``) ->
        float32 ``[L, n, Hkv]``; one batched matmul per surrogate layer instead of ``L``."""
        w1, b1, w2, b2 = self._weights(hidden.device, hidden.dtype)
        assert w1 is not None and b1 is not None
        out = torch.baddbmm(b1[:, None, :], hidden, w1.transpose(1, 2))
        if w2 is not None and b2 is not None:
            out = torch.baddbmm(b2[:, None, :], F.gelu(out), w2.transpose(1, 2))
        return out.float()

    def save(self, path: str | os.PathLike[str]) -> None:
        from safetensors.torch import save_file

        tensors = {"w1": self.w1, "b1": self.b1}
        if self.w2 is not None and self.b2 is not None:
            tensors |= {"w2": self.w2, "b2": self.b2}
        tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(path), metadata=self.meta.to_metadata())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Surrogate:
        """Load a ``.safetensors`` surrogate (float32 master copy)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = SurrogateMeta.from_metadata(f.metadata())
            t = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118
        sur = cls(meta, t["w1"], t["b1"], t.get("w2"), t.get("b2"))
        L, H1, D = sur.w1.shape
        ok = (meta.num_layers, meta.hidden_size) == (L, D) and sur.b1.shape == (L, H1)
        if sur.w2 is None:
            ok = ok and meta.num_kv_heads == H1 and meta.kind == "linear"
        else:
            assert sur.b2 is not None
            ok = ok and sur.w2.shape == (L, meta.num_kv_heads, H1) and meta.kind == "mlp"
            ok = ok and sur.b2.shape == (L, meta.num_kv_heads)
        if not ok:
            raise ValueError(f"{path}: tensor shapes do not match the surrogate's metadata")
        return sur


def _read_surrogate(file: Path) -> Surrogate | None:
    try:
        if not file.is_file() or file.stat().st_size > _MAX_FILE_BYTES:
            return None
        return Surrogate.load(file)
    except Exception:  # a corrupt or foreign file is "no surrogate", said the same way
        return None


def shipped_surrogate(kind: str, shape: ModelShape) -> Surrogate:
    """The surrogate shipped in the package for a model of this shape.

    Raises :class:`SurrogateNotFound` (naming ``agentkv train-kvzap``) when none fits."""
    for folder in sorted(p for p in SHIPPED_DIR.glob("*") if p.is_dir()):
        sur = _read_surrogate(folder / f"{kind}.safetensors")
        if sur is not None and sur.meta.matches(shape):
            return sur
    raise SurrogateNotFound(
        f"payload.policy.surrogate: KVzap ships {kind!r} surrogates only for "
        f"SmolLM2-135M-Instruct; this model ({shape.num_layers} layers, {shape.num_q_heads} "
        f"query / {shape.num_kv_heads} KV heads of dim {shape.head_dim}) has none. Train one "
        f"with `{TRAIN_HINT}` and set KVzap(surrogate_path=DIR)",
        "payload.policy.surrogate",
    )


def surrogate_from_path(path: str, kind: str, shape: ModelShape) -> Surrogate:
    """``DIR/<kind>.safetensors`` as written by ``agentkv train-kvzap --out DIR``.

    Raises :class:`SurrogateNotFound` when the file is missing, unreadable, outside
    ``$AGENTKV_KVZAP_ROOT`` (when set), or trained for another model shape."""
    folder = Path(path).expanduser()
    root = os.environ.get(ROOT_ENV)
    field = "payload.policy.surrogate_path"
    if root is not None:
        try:
            folder.resolve().relative_to(Path(root).resolve())
        except ValueError:
            raise SurrogateNotFound(f"{field}: must lie inside ${ROOT_ENV}", field) from None
    sur = _read_surrogate(folder / f"{kind}.safetensors")
    if sur is None:
        raise SurrogateNotFound(
            f"{field}: no readable {kind}.safetensors KVzap surrogate in {path!r}; "
            f"make one with `{TRAIN_HINT}`",
            field,
        )
    if not sur.meta.matches(shape):
        raise SurrogateNotFound(
            f"{field}: the surrogate in {path!r} was trained for {sur.meta.model!r} "
            f"({sur.meta.num_layers} layers, {sur.meta.num_kv_heads} KV heads), not this model; "
            f"make one with `{TRAIN_HINT}`",
            field,
        )
    return sur
