"""Bit layouts of packed INT4 / INT2 codes in uint8 buffers (torch and Triton versions).

INT4: byte ``j`` holds channel ``2j`` (low nibble) and ``2j+1`` (high nibble).
INT2: byte ``j`` holds channels ``4j + i`` at bits ``2i .. 2i+1`` for i = 0..3.

The Triton helpers unpack in registers and convert codes to float32 with the
``(code | 0x4B000000) as float - 2**23`` trick (two integer/float ALU ops instead of the
slow integer-to-float conversion unit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] integer codes in 0..15 -> [..., D // 2] uint8."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 2] uint8 -> [..., D] uint8 codes in 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] integer codes in 0..3 -> [..., D // 4] uint8."""
    c = codes.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 4] uint8 -> [..., D] uint8 codes in 0..3."""
    parts = [(packed >> s) & 3 for s in (0, 2, 4, 6)]
    return torch.stack(parts, dim=-1).flatten(-2)


@triton.jit
def codes_to_f32(u):
    """int32 codes in [0, 2**23) -> exact float32 values."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def unpack_int4_f32(b):
    """[R, D // 2] uint8 -> [R, D] float32 codes (natural channel order)."""
    x = b.to(tl.int32)
    return codes_to_f32(tl.interleave(x & 15, x >> 4))


@triton.jit
def unpack_int2_f32(b):
    """[R, D // 4] uint8 -> [R, D] float32 codes (natural channel order)."""
    x = b.to(tl.int32)
    u = tl.interleave(tl.interleave(x & 3, (x >> 4) & 3), tl.interleave((x >> 2) & 3, x >> 6))
    return codes_to_f32(u)


@triton.jit
def pack_int4_u8(u, R: tl.constexpr, D: tl.constexpr):
    """[R, D] int32 codes in 0..15 -> [R, D // 2] uint8."""
    lo, hi = tl.split(tl.reshape(u, [R, D // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def pack_int2_u8(u, R: tl.constexpr, D: tl.constexpr):
    """[R, D] int32 codes in 0..3 -> [R, D // 4] uint8."""
    e0, e1 = tl.split(tl.reshape(u, [R, D // 4, 2, 2]))
    c0, c2 = tl.split(e0)
    c1, c3 = tl.split(e1)
    return (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8)
