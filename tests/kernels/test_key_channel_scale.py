"""INT4 keys stored with per-channel power-of-two scales (outlier key channels): the write
path divides, dequant-gather multiplies back, the decode kernel folds the scale into the
query; Triton matches the torch reference and the scales cut the quantization error of keys
with outlier channels."""

from __future__ import annotations

import torch
from mixed_batch import DEVICE

from agentkv.kernels import (
    GATHER_BASE,
    GatherConfig,
    KVPools,
    decode_attention,
    dequant_gather,
    write_int4,
)


def _pools(with_scale: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h, d = 2, 64
    pools = KVPools.allocate(64, 64, 0, h, d, torch.bfloat16, DEVICE)
    channel = torch.ones(h, d)
    channel[:, ::9] = 16.0  # a few outlier channels, as real keys have
    k = (torch.randn(64, h, d, generator=g) * channel).to(DEVICE)
    v = torch.randn(64, h, d, generator=g).to(DEVICE)
    if with_scale:
        pools.int4.k_channel = channel.to(DEVICE)
    write_int4(pools.int4, torch.arange(64, device=DEVICE), k, v, backend="torch")
    return pools, k


def test_gather_and_decode_match_reference_with_channel_scales():
    pools, _ = _pools(True)
    ids = (pools.int4_base + torch.arange(64, device=DEVICE)).to(torch.int32)
    kr, vr = dequant_gather(pools, ids, out_dtype=torch.float32, backend="torch")
    for cfg in (GatherConfig(), GATHER_BASE):
        kt, vt = dequant_gather(pools, ids, out_dtype=torch.float32, backend="triton", config=cfg)
        assert torch.equal(kt, kr) and torch.equal(vt, vr), cfg
    sm = pools.int4_base + torch.randperm(64, generator=torch.Generator().manual_seed(1))[:40]
    sm = sm.to(device=DEVICE, dtype=torch.int32)[None].repeat(2, 1)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2))
    q = q.to(device=DEVICE, dtype=torch.bfloat16)
    lens = torch.tensor([40, 33], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, pools, sm, lens, int4_lens=lens, backend="triton")
    ref = decode_attention(q, pools, sm, lens, int4_lens=lens, backend="torch")
    rel = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert rel < 5e-2, rel


def test_channel_scales_cut_the_key_error_of_outlier_channels():
    errs = {}
    for with_scale in (False, True):
        pools, k = _pools(with_scale)
        ids = pools.int4_base + torch.arange(64, device=DEVICE)
        kr, _ = dequant_gather(pools, ids, out_dtype=torch.float32, backend="torch")
        errs[with_scale] = float((kr - k).norm() / k.norm())
    assert errs[True] < 0.8 * errs[False], errs
