"""The asymmetric min/max quantization rule shared by the INT4 and INT2 kernels.

For a group of values ``x`` (float32) and ``qmax = 2**bits - 1``::

    scale = fp16((max(x) - min(x)) / qmax)        zero = fp16(min(x))
    code  = clamp(floor((x - zero) / scale + 0.5), 0, qmax)      (code = 0 where scale == 0)
    x_hat = code * scale + zero

Every division is IEEE round-to-nearest (``tl.div_rn`` in Triton), so the Triton kernels
and the torch reference produce the same codes bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pools import SCALE_DTYPE


def asym_params(mn: torch.Tensor, mx: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group min / max (float32, any shape) -> (scale, zero), both fp16, same shape."""
    scale = ((mx.float() - mn.float()) / qmax).to(SCALE_DTYPE)
    return scale, mn.to(SCALE_DTYPE)


def asym_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmax: int) -> torch.Tensor:
    """float values and broadcastable fp16 scale / zero -> uint8 codes in 0..qmax."""
    s = scale.float()
    ok = s > 0
    t = (x.float() - zero.float()) / torch.where(ok, s, torch.ones_like(s))
    codes = torch.clamp(torch.floor(t + 0.5), 0, qmax)
    return torch.where(ok, codes, torch.zeros_like(codes)).to(torch.uint8)


def asym_dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes and broadcastable fp16 scale / zero -> float32 values ``code * scale + zero``."""
    return codes.float() * scale.float() + zero.float()


@triton.jit
def asym_params_tl(mn, mx, QMAX: tl.constexpr):
    """float32 group min / max -> (scale, zero) as fp16 tensors."""
    rng = mx - mn
    scale = tl.div_rn(rng, tl.full(rng.shape, QMAX, tl.float32)).to(tl.float16)
    return scale, mn.to(tl.float16)


@triton.jit
def asym_codes_tl(x, s, z, QMAX: tl.constexpr):
    """float32 values, broadcast float32 scale / zero (already fp16-rounded) -> int32 codes."""
    ok = s > 0.0
    t = tl.div_rn(x - z, tl.where(ok, s, 1.0))
    c = tl.minimum(tl.maximum(tl.floor(t + 0.5), 0.0), QMAX * 1.0)
    return tl.where(ok, c, 0.0).to(tl.int32)
