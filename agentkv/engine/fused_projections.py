"""A layer's projections that read the same input as one GEMM each on CUDA: the attention's
``q``/``k``/``v`` and the gated MLP's ``gate``/``up`` (then ``silu(gate) * up`` in one kernel,
:func:`agentkv.kernels.silu_mul.silu_mul`), as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do.

At batch 1 a decode step is one GEMV per projection, 7 a layer, each a few microseconds
of launch and tail as much as of reading weights: at SmolLM2's shape the GEMVs are half a
CUDA-graph step (docs/benchmarks.md §3, session 35). :func:`fuse_projections` stacks each
group's weights into one tensor and makes the projections' own weights *views* of it (no
memory added; a state dict is unchanged), so one GEMV computes the group:

* the gated MLPs of :data:`MLP_FUSABLE` (``down(act(gate(x)) * up(x))`` with a SiLU act, no
  bias) get a ``forward`` computing ``down(silu_mul(x @ [gate; up]^T))``;
* in the attention layers of :data:`QKV_FUSABLE`, whose ``forward`` calls ``q_proj``,
  ``k_proj``, ``v_proj`` on the same ``hidden_states`` in that order, ``q_proj`` computes all
  three and hands ``k_proj`` and ``v_proj`` their slices when they are called on that same
  tensor (any other input: their own GEMV), so transformers' attention ``forward`` runs
  unchanged.

Only layers on CUDA are stacked (the CPU's model is untouched), they run stacked only on
CUDA inputs outside autograd and only while the views still share the stacked
tensor (a ``model.to()`` gives each parameter new storage: the layers then run unfused);
elsewhere every module runs its own ``forward``. A stacked GEMM may pick another cuBLAS
algorithm than three small ones, so results may differ in the last bits (as between batch
sizes). :data:`PATH` says when (:class:`~agentkv.engine.fused_path.FusedPath`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from agentkv.engine.fused_path import LLAMA_FAMILIES, FusedPath
from agentkv.kernels.silu_mul import silu_mul

#: gated MLPs computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (a test checks the
#: source in the installed transformers)
MLP_FUSABLE = frozenset(f"{family}MLP" for family in LLAMA_FAMILIES)
#: attention layers whose ``forward`` calls ``q_proj``, ``k_proj``, ``v_proj`` on its
#: ``hidden_states`` in that order
QKV_FUSABLE = frozenset(f"{family}Attention" for family in LLAMA_FAMILIES)
#: when the stacked GEMMs run (CUDA, outside autograd; a process-wide switch); only
#: layers on these devices are stacked at all
PATH = FusedPath()
_FUSED = "_agentkv_stacked"


@dataclass
class StackedLinear:
    """``parts`` (``nn.Linear`` modules of one input width) computed as one GEMM over
    ``weight`` ``[sum(out_features), in_features]``, whose row blocks are their weights (and
    ``bias`` likewise, or None)."""

    parts: tuple[torch.nn.Linear, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    @classmethod
    def stack(cls, parts: tuple[torch.nn.Linear, ...]) -> StackedLinear | None:
        """Stack ``parts``' weights into one tensor and make theirs views of it; None where
        they cannot share one GEMM (another class, width, dtype or device, a bias on some
        only, a weight that is not a plain tensor)."""
        if not all(type(p) is torch.nn.Linear for p in parts):
            return None
        ws = [p.weight for p in parts]
        if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
            return None
        if len({p.bias is None for p in parts}) != 1:
            return None
        if any(type(w) is not torch.nn.Parameter or w.is_meta for w in ws):
            return None
        sizes = tuple(w.shape[0] for w in ws)
        weight = _stack_into_views(parts, "weight")
        bias = _stack_into_views(parts, "bias") if parts[0].bias is not None else None
        return cls(parts, weight, bias, sizes)

    def intact(self) -> bool:
        """Whether every part's weight (and bias) is still a view of the stacked tensors."""
        return _views_intact(self.weight, [p.weight for p in self.parts]) and (
            self.bias is None or _views_intact(self.bias, [p.bias for p in self.parts])
        )

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every part's output: ``x [..., in]`` -> ``([..., out_i] for each part)``, views
        of one GEMM's output."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _stack_into_views(parts: tuple[torch.nn.Linear, ...], name: str) -> torch.Tensor:
    """Concatenate the parts' ``name`` parameters (rows) and give each part its rows of the
    result as its parameter; the old tensors go with their last reference."""
    olds = [getattr(p, name) for p in parts]
    stacked = torch.cat([t.detach() for t in olds], dim=0)
    row = 0
    for part, old in zip(parts, olds, strict=True):
        view = stacked[row : row + old.shape[0]]
        setattr(part, name, torch.nn.Parameter(view, requires_grad=old.requires_grad))
        row += old.shape[0]
    return stacked


def _views_intact(stacked: torch.Tensor, views: list[torch.Tensor]) -> bool:
    ptr, step = stacked.data_ptr(), stacked.element_size() * stacked[0].numel()
    row = 0
    for v in views:
        if v.data_ptr() != ptr + row * step:
            return False
        row += v.shape[0]
    return True


def _is_silu(act: Any) -> bool:
    return type(act) is torch.nn.SiLU or type(act).__name__ == "SiLUActivation"


def fuse_projections(model: torch.nn.Module) -> int:
    """Stack the q/k/v and gate/up projections of every fusable layer of ``model``
    (idempotent; see the module's docstring). Returns the number of layers that run
    stacked."""
    n = 0
    for module in model.modules():
        name = type(module).__name__
        if name not in MLP_FUSABLE | QKV_FUSABLE:
            continue
        if getattr(module, _FUSED, None) is not None:
            n += 1
        elif next(module.parameters()).device.type not in PATH.devices:
            continue  # (a CPU model stays as loaded)
        elif name in MLP_FUSABLE and _is_silu(getattr(module, "act_fn", None)):
            n += _fuse_mlp(module)
        elif name in QKV_FUSABLE:
            n += _fuse_qkv(module)
    return n


def _fuse_mlp(mlp: Any) -> int:
    if mlp.gate_proj.bias is not None:  # (bias-free gated MLPs only)
        return 0
    stacked = StackedLinear.stack((mlp.gate_proj, mlp.up_proj))
    if stacked is None:
        return 0
    original = mlp.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if PATH.takes(x) and stacked.intact():
            return mlp.down_proj(silu_mul(F.linear(x, stacked.weight), backend="triton"))
        return original(x)

    mlp.forward = forward
    setattr(mlp, _FUSED, stacked)
    return 1


class _PendingKV(threading.local):
    """``k_proj``'s and ``v_proj``'s outputs for ``x``, computed with ``q_proj``'s: per
    thread, so forwards of one model in two threads never take each other's."""

    x: torch.Tensor | None = None
    outputs: dict[str, torch.Tensor] = {}  # noqa: RUF012 (a default only: always replaced)


def _fuse_qkv(attn: Any) -> int:
    stacked = StackedLinear.stack((attn.q_proj, attn.k_proj, attn.v_proj))
    if stacked is None:
        return 0
    pending = _PendingKV()
    q_forward = attn.q_proj.forward

    def q_proj(x: torch.Tensor) -> torch.Tensor:
        pending.x, pending.outputs = None, {}
        if not (PATH.takes(x) and stacked.intact()):
            return q_forward(x)
        q, k, v = stacked(x)
        pending.x, pending.outputs = x, {"k": k, "v": v}
        return q

    def handed(key: str, own: Any) -> Any:
        def proj(x: torch.Tensor) -> torch.Tensor:
            if pending.x is x and key in pending.outputs:
                out = pending.outputs.pop(key)
                if not pending.outputs:  # (both handed: hold nothing past the layer)
                    pending.x = None
                return out
            return own(x)

        return proj

    attn.q_proj.forward = q_proj
    attn.k_proj.forward = handed("k", attn.k_proj.forward)
    attn.v_proj.forward = handed("v", attn.v_proj.forward)
    setattr(attn, _FUSED, stacked)
    return 1
