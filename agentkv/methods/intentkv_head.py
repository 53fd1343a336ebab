"""IntentKV Phase-2: the zero-initialised residual head over the rule score.

For candidate ``i`` with rule score ``s_i`` (:mod:`agentkv.methods.intentkv`)::

    s~_i = log(|C| s_i) + alpha * MLP([phi_i ; c_i]),    phi_i = [k_i ; m ; k_i * m]

- ``k_i [D]``: post-RoPE key of position ``i`` averaged over layers and (GQA-expanded) heads;
  ``m [D]``: the probe (session memory) averaged the same way.
- ``c_i [D]``: multi-head cross-attention readout, ``phi_i`` as the query, the averaged keys of
  the live actionable-span positions as keys and values (zero when the span has none live).
- ``MLP``: two layers, GELU, the output layer zero-initialised (weight and bias); ``alpha`` a
  learned scalar (init 1.0), clipped to ``[0, alpha_max]`` at inference.

The rule enters as ``log(|C| s_i)`` (log-ratio to a uniform score over the ``|C|``
candidates): a monotone map of ``s_i``, so top-k of ``s~`` equals top-k of the rule at
initialisation (``s~ = log(|C| s)`` exactly) and whenever ``alpha = 0``, and the residual adds
to a score of order one whatever the history length. Inputs are layer-normalised (key norms
differ by model).

Checkpoints are safetensors files ``head.safetensors`` (metadata: the model shape it was
trained for and, after ``agentkv train-intentkv --calibrate-traces`` or ``agentkv
calibrate-intentkv``, the ``alpha_max`` chosen on held-out replay fidelity over budgets x
length cuts (:mod:`agentkv.train.intentkv_fit`): the clip ``IntentKV(mode="learned")`` uses
when the policy leaves ``alpha_max`` unset; 0 means the head did not beat the rule there);
the package ships one per supported model under ``intentkv_heads/<model>/``,
and ``$AGENTKV_INTENTKV_HEADS`` may name a folder of further ``<name>/head.safetensors``
(written by ``agentkv train-intentkv --out``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from agentkv.methods.base import ModelShape

SHIPPED_DIR = Path(__file__).resolve().parent / "intentkv_heads"
HEADS_ENV = "AGENTKV_INTENTKV_HEADS"
TRAIN_HINT = "agentkv train-intentkv --model MODEL --out DIR"
HEAD_FILE = "head.safetensors"


class HeadNotFound(ValueError):
    """No trained residual head for this model (the message names the command that makes one)."""


@dataclass(frozen=True)
class HeadConfig:
    """Topology of a head and the model shape it was trained for."""

    head_dim: int
    hidden: int = 128
    attn_heads: int = 4
    num_layers: int = 0
    num_q_heads: int = 0
    num_kv_heads: int = 0
    model: str = ""

    def matches(self, shape: ModelShape) -> bool:
        return (self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim) == (
            shape.num_layers,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )

    @staticmethod
    def for_shape(shape: ModelShape, model: str = "", **kw: int) -> HeadConfig:
        return HeadConfig(
            head_dim=shape.head_dim,
            num_layers=shape.num_layers,
            num_q_heads=shape.num_q_heads,
            num_kv_heads=shape.num_kv_heads,
            model=model,
            **kw,
        )


class ResidualHead(nn.Module):
    """The residual head (module docstring). ``forward`` works on one request's candidates."""

    def __init__(self, config: HeadConfig, alpha_init: float = 1.0):
        super().__init__()
        D = config.head_dim
        if D % config.attn_heads:
            raise ValueError(f"head_dim {D} is not divisible by attn_heads {config.attn_heads}")
        self.config = config
        self.norm_phi = nn.LayerNorm(3 * D)
        self.norm_key = nn.LayerNorm(D)
        self.attn_q = nn.Linear(3 * D, D)
        self.attn_k = nn.Linear(D, D)
        self.attn_v = nn.Linear(D, D)
        self.attn_o = nn.Linear(D, D)
        self.mlp = nn.Sequential(
            nn.Linear(4 * D, config.hidden), nn.GELU(), nn.Linear(config.hidden, 1)
        )
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        #: the clip calibrated on held-out replay fidelity (checkpoint metadata), if any
        self.calibrated_alpha_max: float | None = None

    def residual(
        self,
        k_bar: torch.Tensor,
        m_bar: torch.Tensor,
        q_keys: torch.Tensor,
        cross_attention: bool = True,
    ) -> torch.Tensor:
        """``MLP([phi ; c])`` float32 ``[N]`` for candidate keys ``k_bar [N, D]``, memory
        ``m_bar [D]`` and the actionable span's keys ``q_keys [M, D]`` (``M`` may be 0).
        ``cross_attention=False`` forces ``c = 0`` (the paper's x-attn ablation)."""
        D, H = self.config.head_dim, self.config.attn_heads
        m = m_bar.expand_as(k_bar)
        phi = self.norm_phi(torch.cat([k_bar, m, k_bar * m], dim=-1))  # [N, 3D]
        if q_keys.shape[0] == 0 or not cross_attention:
            c = torch.zeros_like(k_bar)
        else:
            kv = self.norm_key(q_keys)
            q = self.attn_q(phi).view(-1, H, D // H).transpose(0, 1)  # [H, N, D/H]
            k = self.attn_k(kv).view(-1, H, D // H).transpose(0, 1)  # [H, M, D/H]
            v = self.attn_v(kv).view(-1, H, D // H).transpose(0, 1)
            w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D // H), dim=-1)
            c = self.attn_o((w @ v).transpose(0, 1).reshape(-1, D))  # [N, D]
        return self.mlp(torch.cat([phi, c], dim=-1)).squeeze(-1)

    def alpha_value(self, alpha_max: float | None = None) -> torch.Tensor:
        """``alpha``, clipped to ``[0, alpha_max]`` when ``alpha_max`` is given (inference)."""
        return self.alpha if alpha_max is None else self.alpha.clamp(0.0, alpha_max)

    def inference_alpha_max(self, policy_alpha_max: float | None) -> float:
        """The clip at inference: the policy's when set, else the calibrated one, else 1.0."""
        if policy_alpha_max is not None:
            return policy_alpha_max
        if self.calibrated_alpha_max is not None:
            return self.calibrated_alpha_max
        return 1.0

    def forward(
        self,
        rule_logit: torch.Tensor,
        k_bar: torch.Tensor,
        m_bar: torch.Tensor,
        q_keys: torch.Tensor,
        alpha_max: float | None = None,
        *,
        cross_attention: bool = True,
        with_rule: bool = True,
    ) -> torch.Tensor:
        """``s~ [N] = rule_logit + alpha * MLP(...)`` (``rule_logit = log(|C| s)``, see
        :func:`rule_logit`). Ablations: ``cross_attention=False`` forces ``c = 0``;
        ``with_rule=False`` drops ``rule_logit`` (the head alone ranks)."""
        res = self.alpha_value(alpha_max) * self.residual(
            k_bar, m_bar, q_keys, cross_attention=cross_attention
        )
        return rule_logit + res if with_rule else res

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: Path, extra: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"config": json.dumps(asdict(self.config))} | (extra or {})
        if self.calibrated_alpha_max is not None:
            meta["alpha_max"] = repr(float(self.calibrated_alpha_max))
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path), meta
        )

    @staticmethod
    def load(path: Path) -> ResidualHead:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        head = ResidualHead(HeadConfig(**json.loads(meta["config"])))
        head.load_state_dict(load_file(str(path)))
        if "alpha_max" in meta:
            head.calibrated_alpha_max = float(meta["alpha_max"])
        return head.eval()


def rule_logit(scores: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``log(|C| s)`` of the candidates' rule scores ``scores [N]`` (softmax mass over C)."""
    return torch.log(scores.double().clamp_min(eps) * scores.numel()).float()


def head_for(shape: ModelShape) -> ResidualHead:
    """The trained head for a model of this shape: ``$AGENTKV_INTENTKV_HEADS/*/`` first, then
    the heads shipped in the package. Raises :class:`HeadNotFound` naming the command."""
    folders = []
    extra = os.environ.get(HEADS_ENV)
    if extra:
        folders += sorted(p for p in Path(extra).expanduser().glob("*") if p.is_dir())
        folders.append(Path(extra).expanduser())
    folders += sorted(p for p in SHIPPED_DIR.glob("*") if p.is_dir())
    for folder in folders:
        path = folder / HEAD_FILE
        if not path.is_file():
            continue
        head = ResidualHead.load(path)
        if head.config.matches(shape):
            return head
    shipped = sorted(p.name for p in SHIPPED_DIR.glob("*") if (p / HEAD_FILE).is_file())
    raise HeadNotFound(
        f"policy.mode: IntentKV(mode='learned') needs a residual head trained for this model "
        f"({shape.num_layers} layers, {shape.num_q_heads} query / {shape.num_kv_heads} KV heads "
        f"of dim {shape.head_dim}); the package ships heads for {shipped or 'no model yet'}. "
        f"Train one with `{TRAIN_HINT}` and put DIR under ${HEADS_ENV}"
    )
