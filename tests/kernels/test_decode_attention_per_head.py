"""decode_attention with per-(layer, head) slot maps ``[B, Hkv, L]`` and per-head lengths
``[B, Hkv]``: Triton (interpreter on CPU) against the torch reference, against the shared-map
kernel run head by head, and equal to the shared-map result when every head has one map."""

from __future__ import annotations

import pytest
import torch
from mixed_batch import KNOBS_ON, build_mixed_batch, int4_config

from agentkv.kernels import (
    DEAD,
    DecodeConfig,
    SegmentMaxLens,
    decode_attention,
    decode_attention_ref,
    validate_decode_inputs,
)

TOL = {torch.float16: 3e-3, torch.bfloat16: 3e-2 if torch.cuda.is_available() else 5e-2}


class PerHeadBatch:
    """A decode batch whose KV head ``h`` of request ``b`` has its own slot map and lengths.

    Built from a shared-map mixed batch of ``B * Hkv`` rows (row ``b * Hkv + h`` becomes
    head ``h`` of request ``b``), so every head has its own INT2 / INT4 / full cells."""

    def __init__(self, lens, *, hkv, group, d=64, dtype=torch.float16, dead=0.0, hm=0.0, seed=0):
        rows = [x for per_req in lens for x in per_req]
        assert len(rows) % hkv == 0
        mb = build_mixed_batch(
            rows,
            hq=hkv,
            hkv=hkv,
            d=d,
            dtype=dtype,
            dead_fraction=dead,
            head_mask_fraction=hm,
            pad=5,
            seed=seed,
        )
        b = len(rows) // hkv
        self.pools = mb.pools
        self.slot_map = mb.slot_map.view(b, hkv, -1)
        self.seq_lens = mb.seq_lens.view(b, hkv)
        self.int2_lens = mb.int2_lens.view(b, hkv)
        self.int4_lens = mb.int4_lens.view(b, hkv)
        self.head_mask = None
        if mb.head_mask is not None:  # [B * Hkv, Hkv, L]: take each row's own head
            idx = torch.arange(b * hkv, device=mb.head_mask.device)
            self.head_mask = mb.head_mask[idx, idx % hkv].view(b, hkv, -1)
        g = torch.Generator().manual_seed(seed + 1)
        self.q = (torch.randn(b, hkv * group, d, generator=g) * 2.0).to(dtype).to(mb.q.device)

    def run(self, backend="triton", split_len=64, **kw):
        kw.setdefault("head_mask", self.head_mask)
        return decode_attention(
            self.q,
            self.pools,
            self.slot_map,
            self.seq_lens,
            int2_lens=self.int2_lens,
            int4_lens=self.int4_lens,
            split_len=split_len,
            backend=backend,
            **kw,
        )

    def ref(self, **kw):
        kw.setdefault("head_mask", self.head_mask)
        return decode_attention_ref(self.q, self.pools, self.slot_map, self.seq_lens, **kw)


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))


CASES = [
    # id: (lens[b][h] = (int2 pages, int4 tokens, full tokens), hkv, group, dead, head mask)
    ("mha_mixed", [[(1, 10, 20), (0, 30, 5)]], 2, 1, 0.0, 0.0),
    ("gqa4_dead", [[(1, 20, 10), (2, 0, 40)], [(0, 5, 60), (1, 40, 0)]], 2, 4, 0.4, 0.0),
    ("gqa2_headmask", [[(0, 33, 17), (1, 3, 3), (0, 0, 50)]], 3, 2, 0.2, 0.3),
]


@pytest.mark.parametrize(
    ("lens", "hkv", "group", "dead", "hm"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_per_head_matches_reference(lens, hkv, group, dead, hm, dtype):
    pb = PerHeadBatch(lens, hkv=hkv, group=group, dtype=dtype, dead=dead, hm=hm, seed=hkv)
    validate_decode_inputs(pb.pools, pb.slot_map, pb.seq_lens, pb.int2_lens, pb.int4_lens)
    out, ref = pb.run(), pb.ref()
    assert out.shape == pb.q.shape and out.dtype == dtype
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, ref) < TOL[dtype]


def test_per_head_chunked_int4_programs_equal_one_program_per_chunk():
    """Chunked INT4 programs (``DecodeConfig.chunked_splits``) with each head's own map and
    INT4 length (300, 70, 0 and 200 positions): a head whose segment ends before its
    programs' last chunk writes empty rows, bit for bit the launch of one program per chunk
    on the CPU interpreter, and within the kernel's tolerance of the reference."""
    pb = PerHeadBatch(
        [[(0, 300, 9), (0, 70, 5)], [(0, 0, 40), (0, 200, 0)]], hkv=2, group=4, d=128, seed=5
    )
    length = pb.slot_map.shape[-1]
    kw = dict(
        config=DecodeConfig(max_split_len_folded=64),
        max_lens=SegmentMaxLens(int2=0, int4=length, full=length),
        head_mask=None,
    )
    one = pb.run(split_len=64, **kw)  # one chunk a program
    chunked = pb.run(split_len=256, **kw)  # four
    assert rel_err(chunked, pb.ref()) < TOL[torch.float16]
    if one.is_cuda:
        torch.testing.assert_close(chunked, one, atol=1e-3, rtol=1e-3)
    else:
        assert torch.equal(chunked, one)


def test_per_head_equals_the_shared_map_kernel_run_head_by_head():
    pb = PerHeadBatch([[(1, 20, 10), (0, 12, 40)]], hkv=2, group=2, dead=0.3, seed=11)
    out = pb.run()
    for h in range(2):
        shared = decode_attention(
            pb.q,
            pb.pools,
            pb.slot_map[:, h],
            pb.seq_lens[:, h],
            int2_lens=pb.int2_lens[:, h],
            int4_lens=pb.int4_lens[:, h],
            split_len=64,
            backend="triton",
        )
        g = slice(2 * h, 2 * h + 2)  # the query heads of KV head h
        torch.testing.assert_close(out[:, g], shared[:, g], atol=1e-3, rtol=1e-3)
        ref = decode_attention_ref(pb.q, pb.pools, pb.slot_map[:, h], pb.seq_lens[:, h])
        torch.testing.assert_close(pb.ref()[:, g], ref[:, g], atol=0, rtol=0)


@pytest.mark.parametrize("lens_shape", ["per_head", "per_request"])
def test_same_map_for_every_head_equals_the_shared_map(lens_shape):
    mb = build_mixed_batch(
        [(1, 20, 20), (0, 30, 9), (2, 0, 5)], hq=4, hkv=2, d=64, dead_fraction=0.3, seed=12
    )
    b, length = mb.slot_map.shape
    shared = decode_attention(
        mb.q,
        mb.pools,
        mb.slot_map,
        mb.seq_lens,
        int2_lens=mb.int2_lens,
        int4_lens=mb.int4_lens,
        split_len=64,
        backend="triton",
    )

    def lens(x):
        return x[:, None].expand(b, 2).contiguous() if lens_shape == "per_head" else x

    sm = mb.slot_map[:, None, :].expand(b, 2, length).contiguous()
    validate_decode_inputs(mb.pools, sm, lens(mb.seq_lens), lens(mb.int2_lens), lens(mb.int4_lens))
    per_head = decode_attention(
        mb.q,
        mb.pools,
        sm,
        lens(mb.seq_lens),
        int2_lens=lens(mb.int2_lens),
        int4_lens=lens(mb.int4_lens),
        split_len=64,
        backend="triton",
    )
    torch.testing.assert_close(per_head, shared, atol=1e-3, rtol=1e-3)
    ref_shared = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    assert torch.equal(decode_attention_ref(mb.q, mb.pools, sm, lens(mb.seq_lens)), ref_shared)


def test_empty_and_all_dead_heads_give_zeros_for_their_query_heads_only():
    pb = PerHeadBatch([[(1, 10, 10), (0, 8, 8)], [(0, 6, 6), (1, 0, 4)]], hkv=2, group=2, seed=13)
    pb.seq_lens = pb.seq_lens.clone()
    pb.int2_lens = pb.int2_lens.clone()
    pb.int4_lens = pb.int4_lens.clone()
    pb.seq_lens[0, 1] = 0  # request 0, KV head 1: nothing
    pb.int4_lens[0, 1] = 0
    pb.slot_map = pb.slot_map.clone()
    pb.slot_map[1, 0] = DEAD  # request 1, KV head 0: every position evicted
    out, ref = pb.run(), pb.ref()
    assert bool((out[0, 2:] == 0).all()) and bool((out[1, :2] == 0).all())
    assert bool((out[0, :2] != 0).any()) and bool((out[1, 2:] != 0).any())
    assert bool((ref[0, 2:] == 0).all()) and bool((ref[1, :2] == 0).all())
    assert rel_err(out, ref) < TOL[torch.float16]


def test_per_head_dead_slot_and_padding_are_never_read():
    pb = PerHeadBatch([[(1, 10, 20), (0, 20, 20)]], hkv=2, group=2, dead=0.4, seed=14)
    pb.pools.full.k[DEAD] = float("nan")
    pb.pools.full.v[DEAD] = float("nan")
    sm = pb.slot_map.clone()
    for h in range(2):  # out-of-range garbage after each head's own length
        sm[0, h, int(pb.seq_lens[0, h]) :] = 1 << 30
    pb.slot_map = sm
    out = pb.run()
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, pb.ref()) < TOL[torch.float16]


def test_validate_checks_the_segment_contract_per_head():
    pb = PerHeadBatch([[(1, 10, 5), (0, 10, 5)]], hkv=2, group=1, seed=15)
    validate_decode_inputs(pb.pools, pb.slot_map, pb.seq_lens, pb.int2_lens, pb.int4_lens)
    bad = pb.int4_lens.clone()
    bad[0, 1] += 3  # head 1's INT4 segment runs into its full cells
    with pytest.raises(ValueError, match="segment"):
        validate_decode_inputs(pb.pools, pb.slot_map, pb.seq_lens, pb.int2_lens, bad)
    with pytest.raises(ValueError, match="slot_map must be"):
        decode_attention(pb.q, pb.pools, pb.slot_map[:, :1], pb.seq_lens[:, :1], backend="triton")


def test_per_request_lengths_broadcast_over_heads_not_over_requests():
    """Lengths ``[B]`` with a per-head map mean one length per request for all its heads,
    also when mixed with per-head segment lengths and when ``B == Hkv`` (where a trailing-dim
    broadcast would silently swap requests and heads)."""
    mb = build_mixed_batch([(1, 20, 3), (0, 9, 40)], hq=4, hkv=2, d=64, dead_fraction=0.2, seed=16)
    b, length = mb.slot_map.shape
    sm = mb.slot_map[:, None, :].expand(b, 2, length).contiguous()
    per_head_int4 = mb.int4_lens[:, None].expand(b, 2).contiguous()
    validate_decode_inputs(mb.pools, sm, mb.seq_lens, mb.int2_lens, per_head_int4)
    out = decode_attention(
        mb.q,
        mb.pools,
        sm,
        mb.seq_lens,  # [B]
        int2_lens=mb.int2_lens,  # [B]
        int4_lens=per_head_int4,  # [B, Hkv]
        split_len=64,
        backend="triton",
    )
    ref = decode_attention_ref(mb.q, mb.pools, mb.slot_map, mb.seq_lens)
    assert rel_err(out, ref) < TOL[torch.float16]


def test_per_head_int4_imma_matches_reference():
    """The int8 tensor-core INT4 variant (lazy rescale, subnormal value codes) on per-head
    slot maps."""
    pb = PerHeadBatch(
        [[(1, 20, 10), (2, 0, 40)], [(0, 75, 60), (1, 40, 0)]], hkv=2, group=4, dead=0.4, seed=2
    )
    for cfg in (
        int4_config(int4_imma=True, int4_lazy_rescale=True, int4_v_subnormal=True),
        int4_config(**KNOBS_ON),
    ):
        assert rel_err(pb.run(config=cfg), pb.ref()) < 1e-3
