"""RMSNorm in one kernel: the Llama-family layer norm (``LlamaRMSNorm``, ``Qwen2RMSNorm``,
``Qwen3RMSNorm``, ``MistralRMSNorm``) with transformers' rounding.

Eager, transformers' norm is 7-8 small kernels (to float32, square, mean, add, rsqrt, mul,
back to the input dtype, times the weight); a batch-1 decode step runs two or four of them a
layer, ~1.3 us each on an H200 even inside a CUDA graph. :func:`rms_norm` computes the same
rows in one pass: per row ``x`` (``D`` channels), in float32,
``y = x * rsqrt(mean(x^2) + eps)``, rounded to ``x``'s dtype, then ``weight * y`` in the
two operands' promoted dtype (what transformers computes; the float32 sum's order differs,
so an output may differ from it in its last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .rounding import round_to


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference (transformers' ``LlamaRMSNorm.forward``): ``x [..., D]``, ``weight
    [D]`` -> ``[..., D]`` in ``promote_types(weight.dtype, x.dtype)``."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_x,
    stride_y,
    D,
    eps,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    h = x * (1.0 / tl.sqrt(var + eps))
    h = round_to(h, x_ptr.dtype.element_ty)  # (transformers rounds here, to nearest even)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(w * h, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, backend: Backend = "auto"
) -> torch.Tensor:
    """:func:`rms_norm_ref` in one kernel: ``x [..., D]`` (any leading shape, unit stride
    over ``D``), ``weight [D]`` on the same device -> a new ``[..., D]`` tensor."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    if resolve_backend(backend, x.device) == "torch":
        return rms_norm_ref(x, weight, eps)
    rows = x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(D)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            weight.contiguous(),
            out,
            rows.stride(0),
            out.stride(0),
            D,
            float(eps),
            BLOCK_D=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return out.view(x.shape)
