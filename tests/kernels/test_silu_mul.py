"""The gated MLP's one-kernel activation against its torch reference (``silu(gate) * up``),
on the GPU or through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels.silu_mul import silu_mul, silu_mul_ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (2, 3, 2 * 100), (5, 2 * 3000)])
def test_silu_mul_equals_the_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 4).to(device, dtype)
    got, want = silu_mul(x, backend="triton"), silu_mul_ref(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    # float32 exp may differ from torch's in its last bit; rounded to 16 bits that rarely shows
    tol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (got == want).float().mean() > 0.99


def test_silu_mul_reads_strided_rows_and_refuses_an_odd_width(device):
    x = torch.randn(6, 2 * 64, device=device)[::2]  # (rows 2 apart)
    torch.testing.assert_close(silu_mul(x, backend="triton"), silu_mul_ref(x), rtol=1e-6, atol=1e-6)
    assert silu_mul(x[:0], backend="triton").shape == (0, 64)
    with pytest.raises(ValueError, match="must be even"):
        silu_mul(torch.randn(2, 7), backend="triton")
