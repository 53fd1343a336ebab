"""The one-kernel RMSNorm against its torch reference (transformers' ``LlamaRMSNorm``),
on the GPU or through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels.rms_norm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("D", [64, 576, 1000])
@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_rms_norm_equals_the_reference(device, rows, D, x_dtype, w_dtype):
    g = torch.Generator().manual_seed(D + rows)
    x = (torch.randn(2, rows, D, generator=g) * 3).to(device, x_dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device, w_dtype)
    got = rms_norm(x, w, 1e-6, backend="triton")
    want = rms_norm_ref(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype == torch.promote_types(
        w_dtype, x_dtype
    )
    # a rounding step apart at most: only the float32 sum's order and rsqrt differ (the
    # kernel rounds where transformers rounds, in the interpreter too), which a 16-bit
    # output rarely shows
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[x_dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if x_dtype != torch.float32:  # (rounded to 16 bits: equal)
        assert (got == want).float().mean() > 0.97


def test_rms_norm_reads_strided_rows_and_checks_its_weight(device):
    x = torch.randn(3, 8, 128, device=device)[:, ::2]  # (rows 2 apart)
    w = torch.rand(128, device=device)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5, backend="triton"), rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )
    assert rms_norm(x[:, :0], w, 1e-5, backend="triton").shape == (3, 0, 128)
    with pytest.raises(ValueError, match=r"weight must be \[128\]"):
        rms_norm(x, w[:64], 1e-5)
