"""Rotary position embedding of a layer's queries and keys in one kernel, with transformers'
rounding (``apply_rotary_pos_emb`` of the Llama, Mistral, Qwen2 and Qwen3 families).

Eager, transformers rotates ``q`` and ``k`` in about ten small kernels a layer (``x * cos``,
``rotate_half``'s negation and concatenation, ``* sin``, the sum; each for ``q`` and ``k``),
~1.4 us each on an H200 even inside a CUDA graph: at batch 1 about a sixth of a decode
step at SmolLM2's shape. :func:`apply_rotary` computes both in one launch, per channel pair
``(x1, x2) = (x[i], x[i + D/2])``::

    out[i]       = rnd(rnd(x1 * cos[i])       + rnd(-x2 * sin[i]))
    out[i + D/2] = rnd(rnd(x2 * cos[i + D/2]) + rnd( x1 * sin[i + D/2]))

where ``rnd`` rounds to the inputs' dtype (:func:`.rounding.round_to`): each eager kernel
computes in float32 and rounds its result, so 16-bit outputs equal transformers' bit for bit
(float32 ones within an ulp: the GPU may fuse a product into the sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import Backend, resolve_backend
from .rounding import round_to


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference (transformers' ``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``):
    ``q [B, Hq, T, D]``, ``k [B, Hk, T, D]``, ``cos``/``sin [B or 1, T, D]`` -> rotated
    ``(q, k)``, same shapes."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    c1,
    c2,
    s1,
    s2,
    b,
    t,
    H,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_ob,
    stride_oh,
    stride_ot,
    HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate the ``H`` heads of token ``(b, t)``: a ``[BLOCK_H, BLOCK_HALF]`` tile a half."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < H) & (cols < HALF)
    x = x_ptr + b * stride_xb + t * stride_xt + heads * stride_xh + cols
    o = o_ptr + b * stride_ob + t * stride_ot + heads * stride_oh + cols
    dt = o_ptr.dtype.element_ty
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    # each product and the sum rounded as the eager kernels round them (to nearest even)
    a1 = round_to(x1 * c1, dt)
    b1 = round_to(-x2 * s1, dt)
    a2 = round_to(x2 * c2, dt)
    b2 = round_to(x1 * s2, dt)
    tl.store(o, round_to(a1 + b1, dt).to(dt), mask=mask)
    tl.store(o + HALF, round_to(a2 + b2, dt).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qo_ptr,
    ko_ptr,
    T,
    HQ,
    HK,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_qob,
    stride_qoh,
    stride_qot,
    stride_kob,
    stride_koh,
    stride_kot,
    stride_cb,
    stride_ct,
    HALF,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token ``(b, t)``: every query and key head of it."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < HALF
    c = cos_ptr + b * stride_cb + t * stride_ct + cols
    s = sin_ptr + b * stride_cb + t * stride_ct + cols
    c1 = tl.load(c, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(c + HALF, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(s, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(s + HALF, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, qo_ptr, c1, c2, s1, s2, b, t, HQ,
        stride_qb, stride_qh, stride_qt, stride_qob, stride_qoh, stride_qot,
        HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, ko_ptr, c1, c2, s1, s2, b, t, HK,
        stride_kb, stride_kh, stride_kt, stride_kob, stride_koh, stride_kot,
        HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def rotary_refusal(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """Why :func:`apply_rotary` cannot take these inputs (``""`` where it can): 4-d ``q``/``k``
    of one dtype with unit stride over an even ``D``, 3-d ``cos``/``sin`` of that dtype whose
    batch is 1 or ``q``'s and whose ``T`` and ``D`` are ``q``'s."""
    if q.dim() != 4 or k.dim() != 4:
        return "q and k must be [B, H, T, D]"
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2:] != (T, D):
        return f"k must be [{B}, Hk, {T}, {D}], got {tuple(k.shape)}"
    if D % 2:
        return f"the head dim must be even, got {D}"
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (T, D):
        return f"cos and sin must be [B or 1, {T}, {D}], got {tuple(cos.shape)}, {tuple(sin.shape)}"
    if cos.shape[0] not in (1, B):
        return f"cos's batch must be 1 or {B}, got {cos.shape[0]}"
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) != 1:
        return "q, k, cos and sin must share a dtype"
    if len({q.device, k.device, cos.device, sin.device}) != 1:
        return "q, k, cos and sin must be on one device"
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return "q and k must have unit stride over D"
    return ""


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rotary_ref` in one kernel: ``q [B, Hq, T, D]`` and ``k [B, Hk, T, D]``
    (any strides with unit stride over ``D``, e.g. the transposed projections),
    ``cos``/``sin [B or 1, T, D]``, all of one dtype -> new ``(q, k)`` with the inputs'
    strides. Raises ``ValueError`` on inputs :func:`rotary_refusal` refuses."""
    why = rotary_refusal(q, k, cos, sin)
    if why:
        raise ValueError(why)
    if resolve_backend(backend, q.device) == "torch":
        return apply_rotary_ref(q, k, cos, sin)
    qo, ko = torch.empty_like(q), torch.empty_like(k)  # (the inputs' strides, as eager)
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    if B * T == 0:
        return qo, ko
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0
    _rotary_kernel[(B * T,)](
        q, k, cos, sin, qo, ko, T, HQ, HK,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2),
        ko.stride(0), ko.stride(1), ko.stride(2),
        stride_cb, cos.stride(1), D // 2,
        BLOCK_HQ=triton.next_power_of_2(HQ),
        BLOCK_HK=triton.next_power_of_2(HK),
        BLOCK_HALF=triton.next_power_of_2(D // 2),
        num_warps=4 if HQ * D <= 8192 else 8,
    )  # fmt: skip
    return qo, ko
