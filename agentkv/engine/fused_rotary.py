"""The model's rotary embedding of queries and keys in one kernel on CUDA
(:func:`agentkv.kernels.rotary.apply_rotary`).

transformers rotates a layer's ``q`` and ``k`` in about ten small kernels; at batch 1 they are
~0.4 ms of a ~2.4 ms CUDA-graph decode step at SmolLM2's shape (docs/benchmarks.md §3,
session 35). The attention classes of :data:`FUSABLE` call their modeling module's
``apply_rotary_pos_emb`` by its global name; :func:`fuse_rotary` replaces that global in
each module a model uses with a function that runs the one-kernel rotation on CUDA inputs
it supports and transformers' own function on everything else. The kernel rounds where
transformers rounds, so a 16-bit model's rotations are transformers' bit for bit (a float32
one's within an ulp): the replacement changes no result of a 16-bit model in the process,
only the time. :data:`PATH` says when
(:class:`~agentkv.engine.fused_path.FusedPath`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from agentkv.engine.fused_path import LLAMA_FAMILIES, FusedPath
from agentkv.kernels.rotary import apply_rotary, rotary_refusal

#: attention classes that rotate with ``apply_rotary_pos_emb(q, k, cos, sin)`` of their
#: modeling module, which is transformers' Llama function there (a test checks the source)
FUSABLE = frozenset(f"{family}Attention" for family in LLAMA_FAMILIES)
#: when the one-kernel rotation runs (CUDA, outside autograd; a process-wide switch)
PATH = FusedPath()
_FUSED = "_agentkv_fused_rotary"


def fuse_rotary(model: torch.nn.Module) -> int:
    """Route the rotary embedding of every :data:`FUSABLE` attention layer of ``model``
    through the one-kernel rotation on CUDA (idempotent). Returns the number of layers
    whose rotation runs fused."""
    n = 0
    for module in model.modules():
        if type(module).__name__ not in FUSABLE:
            continue
        modeling = sys.modules[type(module).__module__]
        original = getattr(modeling, "apply_rotary_pos_emb", None)
        if original is None:
            continue
        if not getattr(original, _FUSED, False):
            modeling.apply_rotary_pos_emb = _fused_rotary(original)
        n += 1
    return n


def _fused_rotary(original: Any) -> Any:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if PATH.takes(q) and unsqueeze_dim == 1 and not rotary_refusal(q, k, cos, sin):
            return apply_rotary(q, k, cos, sin, backend="triton")
        return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    setattr(apply_rotary_pos_emb, _FUSED, True)
    return apply_rotary_pos_emb
