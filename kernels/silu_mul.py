"""The gated MLP's activation in one kernel: ``silu(gate) * up`` over one merged projection
(the Llama, Mistral, Qwen2 and Qwen3 MLPs, with transformers' rounding).

The engine computes a layer's gate and up projections as one GEMM into ``[..., 2I]`` (gate
channels first); eager, the activation is then two kernels (``silu``, ``*``).
:func:`silu_mul` reads both halves once and writes ``[..., I]``: per channel, in float32,
``rnd(rnd(g / (1 + exp(-g))) * u)`` with ``rnd`` rounding to the input dtype
(:func:`.rounding.round_to`), as the two eager kernels round (``exp`` may differ from CUDA's in its last float32 bit, which a 16-bit output
rarely shows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .rounding import round_to


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``gate_up [..., 2I]`` (gate then up) -> ``silu(gate) * up [..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    y_ptr,
    stride_x,
    stride_y,
    INTER,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    x = x_ptr + row * stride_x + cols
    g = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x + INTER, mask=mask, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    a = round_to(g / (1.0 + tl.exp(-g)), dt)
    tl.store(y_ptr + row * stride_y + cols, round_to(a * u, dt).to(dt), mask=mask)


def silu_mul(gate_up: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """:func:`silu_mul_ref` in one kernel: ``gate_up [..., 2I]`` (unit stride over the last
    dim) -> a new ``[..., I]`` tensor of its dtype."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {two_i}")
    if resolve_backend(backend, gate_up.device) == "torch":
        return silu_mul_ref(gate_up)
    I = two_i // 2  # noqa: E741 (the MLP's intermediate size, as transformers names it)
    rows = gate_up.reshape(-1, two_i)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], I), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and I:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(I, block))](
            rows, out, rows.stride(0), out.stride(0), I, BLOCK=block, num_warps=4
        )
    return out.view(*gate_up.shape[:-1], I)
