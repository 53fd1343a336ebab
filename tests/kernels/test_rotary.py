"""The one-kernel rotary embedding against its torch reference (transformers'
``apply_rotary_pos_emb``), on the GPU or through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_refusal


def _cos_sin(batch: int, T: int, D: int, dtype, device, offset: int = 0):
    """transformers' default rotary table: ``[batch, T, D]`` cos and sin in ``dtype``."""
    pos = torch.arange(offset, offset + T, dtype=torch.float32)[None].expand(batch, T)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    emb = torch.cat((pos[..., None] * inv, pos[..., None] * inv), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def _projections(B: int, T: int, H: int, D: int, dtype, device, g: torch.Generator):
    """``[B, H, T, D]`` as the attention layer makes it: a transposed view of ``[B, T, H*D]``."""
    x = (torch.randn(B, T, H * D, generator=g) * 2).to(device, dtype)
    return x.view(B, T, H, D).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,T,HQ,HK,D", [(1, 1, 32, 8, 128), (1, 1, 9, 3, 64), (2, 7, 14, 2, 64)])
def test_rotary_equals_the_reference_bit_for_bit(device, dtype, B, T, HQ, HK, D):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + HQ)
    q = _projections(B, T, HQ, D, dtype, device, g)
    k = _projections(B, T, HK, D, dtype, device, g)
    cos, sin = _cos_sin(1, T, D, dtype, device, offset=4093)  # (large angles)
    got_q, got_k = apply_rotary(q, k, cos, sin, backend="triton")
    want_q, want_k = apply_rotary_ref(q, k, cos, sin)
    if dtype == torch.float32:  # (the GPU may fuse a product into the sum: an ulp apart)
        torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
    else:  # every product and sum rounded where the eager chain rounds it: equal, not close
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()  # (eager's layout)


def test_rotary_takes_a_per_batch_table_and_contiguous_heads(device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 5, 32, generator=g).to(device)  # ([B, H, T, D] contiguous)
    k = torch.randn(3, 2, 5, 32, generator=g).to(device)
    cos, sin = _cos_sin(3, 5, 32, torch.float32, device)
    cos = cos * torch.tensor([1.0, 0.5, 0.25], device=device)[:, None, None]  # (rows differ)
    got = apply_rotary(q, k, cos, sin, backend="triton")
    for a, b in zip(got, apply_rotary_ref(q, k, cos, sin), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # (float32: see above)
    empty = apply_rotary(q[:, :, :0], k[:, :, :0], cos[:, :0], sin[:, :0], backend="triton")
    assert empty[0].shape == (3, 4, 0, 32)


def test_rotary_refuses_what_it_cannot_compute():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8)
    cos = sin = torch.randn(1, 2, 8)
    assert rotary_refusal(q, k, cos, sin) == ""
    assert "share a dtype" in rotary_refusal(q, k, cos.half(), sin.half())
    assert "must be even" in rotary_refusal(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    assert "batch must be 1 or 1" in rotary_refusal(q, k, cos.expand(2, 2, 8), sin.expand(2, 2, 8))
    assert "unit stride" in rotary_refusal(q[..., ::2], k[..., ::2], cos[..., :4], sin[..., :4])
    assert "cos and sin must be" in rotary_refusal(q, k, cos[:, :1], sin[:, :1])
    with pytest.raises(ValueError, match=r"k must be \[1, Hk, 2, 8\]"):
        apply_rotary(q, k[:, :, :1], cos, sin)
