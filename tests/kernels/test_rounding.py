"""``round_to`` (the 16-bit rounding the elementwise kernels share) against torch's own
float32 -> bfloat16 / float16 conversion, on the GPU or through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from agentkv.kernels.rounding import round_to


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, round_to(tl.load(x_ptr + i, mask=m), DT), mask=m)


def _values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values at every scale, ties between ``dtype`` neighbours, random bit
    patterns, the subnormal and overflow edges."""
    g = torch.Generator().manual_seed(0)
    scales = [torch.randn(20000, generator=g) * s for s in (1e-8, 1e-6, 6e-5, 1e-3, 1, 1e2, 6e4)]
    pattern = torch.randint(-(2**31), 2**31 - 1, (40000,), generator=g, dtype=torch.int64)
    pattern = pattern.to(torch.int32).view(torch.float32)
    pattern = pattern[pattern.isfinite() & (pattern.abs() < 1e38)]
    base = torch.randn(20000, generator=g).to(dtype).float()
    kept = {torch.bfloat16: 8, torch.float16: 11}[dtype]  # (significant bits)
    ties = base + torch.ldexp(torch.ones_like(base), torch.frexp(base).exponent - kept - 1)
    edges = torch.tensor(
        [0.0, -0.0, 65504.0, 65519.0, 65520.0, 7e4, 2.0**-25, 1.5 * 2.0**-24, -2.5 * 2.0**-24,
         6.1035e-05, 6.10351e-05, 3.4e38, -3.39e38]
    )  # fmt: skip
    return torch.cat([*scales, pattern, ties, edges])


@pytest.mark.parametrize(
    "dtype,tl_dtype", [(torch.bfloat16, tl.bfloat16), (torch.float16, tl.float16)]
)
def test_round_to_rounds_as_torch_converts(device, dtype, tl_dtype):
    x = _values(dtype).to(device)
    y = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), DT=tl_dtype, BLOCK=1024)
    want = x.to(dtype)
    assert torch.equal(y.to(dtype), want)  # (infinities included)
    finite = want.isfinite()
    assert torch.equal(y[finite], want[finite].float())  # (already a 16-bit value)
