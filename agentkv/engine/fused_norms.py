"""The model's RMSNorm layers in one kernel each on CUDA (:func:`agentkv.kernels.rms_norm`).

transformers' Llama-family norm is 7-8 small kernels; a batch-1 decode step runs two to four
of them a layer, so at SmolLM2's shape they are a fifth of a CUDA-graph step's kernels
(docs/benchmarks.md §3 session 34). :func:`fuse_rms_norms` gives each norm module of a
class in :data:`FUSABLE` (whose ``forward`` is exactly
:func:`~agentkv.kernels.rms_norm.rms_norm_ref`) a ``forward`` that runs the one-kernel norm
on CUDA inputs and the module's own ``forward`` elsewhere (the CPU path is unchanged; the
kernel has no backward, so a forward under autograd is the module's own too).
:data:`PATH` says when (:class:`~agentkv.engine.fused_path.FusedPath`).
"""

from __future__ import annotations

from typing import Any

import torch

from agentkv.engine.fused_path import LLAMA_FAMILIES, FusedPath
from agentkv.kernels import rms_norm

#: transformers' norm classes computing ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``
#: in float32 (their ``weight`` and ``variance_epsilon`` attributes)
FUSABLE = frozenset(f"{family}RMSNorm" for family in LLAMA_FAMILIES)
#: when the one-kernel norm runs (CUDA, outside autograd; a process-wide switch)
PATH = FusedPath()
_FUSED = "_agentkv_fused_rms_norm"


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Give every :data:`FUSABLE` norm of ``model`` the one-kernel ``forward`` on CUDA
    (idempotent). Returns the number of norms that run fused."""
    n = 0
    for module in model.modules():
        if type(module).__name__ not in FUSABLE:
            continue
        if not (hasattr(module, "weight") and hasattr(module, "variance_epsilon")):
            continue
        if not getattr(module, _FUSED, False):
            module.forward = _fused_forward(module, module.forward)
            setattr(module, _FUSED, True)
        n += 1
    return n


def _fused_forward(module: Any, original: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if PATH.takes(hidden_states):
            return rms_norm(hidden_states, module.weight, module.variance_epsilon, backend="triton")
        return original(hidden_states)

    return forward
