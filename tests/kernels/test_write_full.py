"""The one-kernel write of full-precision K/V rows into pool cells against its torch
reference (indexed assignment), on the GPU or through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels import FullPool, write_full, write_full_ref


def _pool(slots: int, H: int, D: int, dtype, device, stacked: bool) -> FullPool:
    """A pool, or one layer's view of a stacked ``[L, slots, H, D]`` pool (as the store's)."""
    if stacked:
        k = torch.zeros(3, slots, H, D, dtype=dtype, device=device)[1]
        v = torch.zeros(3, slots, H, D, dtype=dtype, device=device)[2]
        return FullPool(k, v)
    z = torch.zeros(slots, H, D, dtype=dtype, device=device)
    return FullPool(z, z.clone())


@pytest.mark.parametrize("n,H,D", [(1, 8, 128), (1, 3, 64), (37, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stacked", [False, True])
def test_write_full_stores_what_indexed_assignment_stores(device, n, H, D, dtype, stacked):
    g = torch.Generator().manual_seed(n * H + D)
    slots = 96
    cells = torch.stack([torch.randperm(slots - 1, generator=g)[:n] + 1 for _ in range(H)])
    # [n, Hkv, D] as the attention layer hands them: a transposed view
    k = torch.randn(1, H, n, D, generator=g).to(device, torch.float32)[0].transpose(0, 1)
    v = torch.randn(n, H, D, generator=g).to(device, torch.bfloat16)  # (cast to the pool's)
    got, want = (
        _pool(slots, H, D, dtype, device, stacked),
        _pool(slots, H, D, dtype, device, stacked),
    )
    write_full(got, cells.to(device), k, v, backend="triton")
    write_full_ref(want, cells.to(device), k, v)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    assert bool((got.k[cells[0].to(device), 0] != 0).any())  # (rows landed)


def test_write_full_checks_shapes(device):
    pool = _pool(8, 2, 32, torch.float32, device, False)
    with pytest.raises(ValueError, match=r"k and v must be \[1, 2, 32\]"):
        write_full(
            pool, torch.ones(2, 1, dtype=torch.int64), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16)
        )
    write_full(
        pool,
        torch.ones(2, 0, dtype=torch.int64, device=device),
        torch.zeros(0, 2, 32),
        torch.zeros(0, 2, 32),
        backend="triton",
    )
    assert not pool.k.any()
