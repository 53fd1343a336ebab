"""Bit packing (kernels/packing.py) and the asymmetric rule (kernels/asymmetric_quant.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kernels.asymmetric_quant import asym_codes, asym_dequant, asym_params
from agentkv.kernels.backend import triton_interpreting
from agentkv.kernels.packing import (
    dequant_int2_quads,
    dequant_int4_pairs,
    int2_code_quads,
    int2_code_quads_subnormal,
    int2_word_planes_f16,
    int4_code_bytes_i8,
    int4_code_pairs,
    int4_word_codes_f16,
    int4_word_codes_f16_subnormal,
    pack_int2,
    pack_int2_u8,
    pack_int4,
    pack_int4_u8,
    unpack_int2,
    unpack_int2_f32,
    unpack_int4,
    unpack_int4_f32,
    unpack_int4_words_f32,
)


@given(rows=st.integers(1, 5), groups=st.integers(1, 4), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_torch_pack_roundtrip(rows: int, groups: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    c4 = torch.randint(0, 16, (rows, 32 * groups), generator=g, dtype=torch.uint8)
    c2 = torch.randint(0, 4, (rows, 32 * groups), generator=g, dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(c4)), c4)
    assert torch.equal(unpack_int2(pack_int2(c2)), c2)
    assert pack_int4(c4).shape[-1] == 16 * groups and pack_int2(c2).shape[-1] == 8 * groups


def test_pack_layout_is_documented_one() -> None:
    c = torch.tensor([[1, 2, 3, 0, 3, 3, 0, 1]], dtype=torch.uint8)
    assert pack_int4(c)[0, 0] == 1 | (2 << 4)  # channels 0, 1
    # planar INT2: byte j holds channels j, j + D/4, j + D/2, j + 3D/4 (D = 8)
    assert pack_int2(c)[0, 0] == 1 | (3 << 2) | (3 << 4) | (0 << 6)
    assert pack_int2(c)[0, 1] == 2 | (0 << 2) | (3 << 4) | (1 << 6)


@triton.jit
def _roundtrip_kernel(
    p4_ptr, p2_ptr, u4_ptr, u2_ptr, r4_ptr, r2_ptr, R: tl.constexpr, D: tl.constexpr
):
    r = tl.arange(0, R)
    b4 = tl.load(p4_ptr + r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :])
    b2 = tl.load(p2_ptr + r[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
    f4 = unpack_int4_f32(b4)
    c0, c1, c2, c3 = unpack_int2_f32(b2)
    od = r[:, None] * D + tl.arange(0, D)[None, :]
    oq = r[:, None] * D + tl.arange(0, D // 4)[None, :]
    tl.store(u4_ptr + od, f4)
    tl.store(u2_ptr + oq, c0)
    tl.store(u2_ptr + oq + D // 4, c1)
    tl.store(u2_ptr + oq + D // 2, c2)
    tl.store(u2_ptr + oq + 3 * (D // 4), c3)
    tl.store(
        r4_ptr + r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :],
        pack_int4_u8(f4.to(tl.int32), R, D),
    )
    tl.debug_barrier()
    f2 = tl.load(u2_ptr + od)  # natural channel order, written above (same program)
    tl.store(
        r2_ptr + r[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :],
        pack_int2_u8(f2.to(tl.int32), R, D),
    )


def test_triton_unpack_and_pack_match_torch(device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    rows, d = 4, 64
    p4 = torch.randint(0, 256, (rows, d // 2), generator=g, dtype=torch.uint8).to(device)
    p2 = torch.randint(0, 256, (rows, d // 4), generator=g, dtype=torch.uint8).to(device)
    u4 = torch.empty(rows, d, device=device)
    u2 = torch.empty_like(u4)
    r4, r2 = torch.empty_like(p4), torch.empty_like(p2)
    _roundtrip_kernel[(1,)](p4, p2, u4, u2, r4, r2, R=rows, D=d)
    assert torch.equal(u4, unpack_int4(p4).float())
    assert torch.equal(u2, unpack_int2(p2).float())
    assert torch.equal(r4, p4) and torch.equal(r2, p2)


@given(
    bits=st.sampled_from([2, 4]),
    scale=st.floats(1e-3, 1e2),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_asymmetric_error_within_half_step(bits: int, scale: float, seed: int) -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed)) * scale
    qmax = (1 << bits) - 1
    s, z = asym_params(x.amin(-1), x.amax(-1), qmax)
    codes = asym_codes(x, s[:, None], z[:, None], qmax)
    assert int(codes.max()) <= qmax
    xh = asym_dequant(codes, s[:, None], z[:, None])
    step = s.float()[:, None]
    # half a step, plus the fp16 rounding of scale (x qmax) and of the zero point
    slack = step * (0.5 + qmax * 2**-10) + z.float().abs()[:, None] * 2**-10 + 1e-6
    assert bool(((x - xh).abs() <= slack).all())


def test_constant_group_dequantizes_to_its_value() -> None:
    x = torch.full((2, 32), 0.75)
    s, z = asym_params(x.amin(-1), x.amax(-1), 15)
    codes = asym_codes(x, s[:, None], z[:, None], 15)
    assert torch.equal(codes, torch.zeros_like(codes))
    assert torch.equal(asym_dequant(codes, s[:, None], z[:, None]), x)


@triton.jit
def _dequant_kernel(
    p4_ptr,
    p2_ptr,
    s_ptr,
    z_ptr,
    o4_ptr,
    oc_ptr,
    o2_ptr,
    R: tl.constexpr,
    C: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    rc = r * C + c
    b4 = tl.load(p4_ptr + rc)
    b2 = tl.load(p2_ptr + rc)
    s = tl.load(s_ptr + rc)
    z = tl.load(z_ptr + rc)
    even, odd = dequant_int4_pairs(b4, s, z, USE_ASM)
    tl.store(o4_ptr + r * (2 * C) + 2 * c, even)
    tl.store(o4_ptr + r * (2 * C) + 2 * c + 1, odd)
    c0, c1, c2, c3 = int2_code_quads(b2, s.dtype, USE_ASM)
    ob = r * (4 * C) + c  # planar INT2: output i is channel block i
    tl.store(oc_ptr + ob, c0)
    tl.store(oc_ptr + ob + C, c1)
    tl.store(oc_ptr + ob + 2 * C, c2)
    tl.store(oc_ptr + ob + 3 * C, c3)
    n = R * C  # per-output scale / zero planes
    v0, v1, v2, v3 = dequant_int2_quads(
        b2,
        tl.load(s_ptr + n + rc),
        tl.load(z_ptr + n + rc),
        tl.load(s_ptr + 2 * n + rc),
        tl.load(z_ptr + 2 * n + rc),
        tl.load(s_ptr + 3 * n + rc),
        tl.load(z_ptr + 3 * n + rc),
        tl.load(s_ptr + 4 * n + rc),
        tl.load(z_ptr + 4 * n + rc),
        USE_ASM,
    )
    tl.store(o2_ptr + ob, v0)
    tl.store(o2_ptr + ob + C, v1)
    tl.store(o2_ptr + ob + 2 * C, v2)
    tl.store(o2_ptr + ob + 3 * C, v3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_register_dequant_matches_torch(dtype, device) -> None:
    """The packed-PTX path on GPU, its plain-Triton twin under the CPU interpreter."""
    g = torch.Generator().manual_seed(2)
    rows, cols = 8, 32
    p4 = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    p2 = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    s = (torch.rand(5, rows, cols, generator=g) * 0.5 + 0.01).to(dtype)  # plane 0: INT4
    z = (torch.randn(5, rows, cols, generator=g) * 2).to(dtype)  # planes 1..4: INT2 blocks
    o4 = torch.empty(rows, 2 * cols, dtype=dtype, device=device)
    oc = torch.empty(rows, 4 * cols, dtype=dtype, device=device)
    o2 = torch.empty_like(oc)
    dev = [t.to(device) for t in (p4, p2, s, z)]
    _dequant_kernel[(1,)](*dev, o4, oc, o2, R=rows, C=cols, USE_ASM=device.type == "cuda")
    sf, zf = s.float(), z.float()
    want4 = unpack_int4(p4).float() * sf[0].repeat_interleave(2, 1) + zf[0].repeat_interleave(2, 1)
    codes2 = unpack_int2(p2).float()  # [rows, 4 * cols], block i = bit pair i
    want2 = codes2 * torch.cat(list(sf[1:]), 1) + torch.cat(list(zf[1:]), 1)
    assert torch.equal(oc.cpu().float(), codes2)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10  # one rounding of the result
    for got, want in ((o4, want4), (o2, want2)):
        err = (got.cpu().float() - want).abs()
        assert bool((err <= ulp * want.abs() + ulp * zf.abs().max() + 1e-6).all()), float(err.max())


@triton.jit
def _store_word_codes(
    wl_ptr, wh_ptr, R: tl.constexpr, D: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7
):
    """The eight [R, D // 8] code tensors of a word unpacking, stored in channel order: low
    nibbles (even channels) to wl, high nibbles (odd channels) to wh, [R, D // 2] each."""
    r = tl.arange(0, R)
    ow = r[:, None] * (D // 2) + 4 * tl.arange(0, D // 8)[None, :]  # byte 4w + k
    tl.store(wl_ptr + ow, c0)
    tl.store(wl_ptr + ow + 1, c1)
    tl.store(wl_ptr + ow + 2, c2)
    tl.store(wl_ptr + ow + 3, c3)
    tl.store(wh_ptr + ow, c4)
    tl.store(wh_ptr + ow + 1, c5)
    tl.store(wh_ptr + ow + 2, c6)
    tl.store(wh_ptr + ow + 3, c7)


@triton.jit
def _int4_views_kernel(
    p_ptr, nat_ptr, lo_ptr, hi_ptr, wl_ptr, wh_ptr, R: tl.constexpr, D: tl.constexpr
):
    r = tl.arange(0, R)
    b = tl.load(p_ptr + r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :])
    w = tl.load(
        p_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :]
    )
    tl.store(
        nat_ptr + r[:, None] * D + tl.arange(0, D)[None, :], unpack_int4_words_f32(w, R, D // 8)
    )
    lo, hi = int4_code_pairs(b, tl.float16, False)
    ob = r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    tl.store(lo_ptr + ob, lo)
    tl.store(hi_ptr + ob, hi)
    c0, c1, c2, c3, c4, c5, c6, c7 = int4_word_codes_f16(w, False, False)
    _store_word_codes(wl_ptr, wh_ptr, R, D, c0, c1, c2, c3, c4, c5, c6, c7)


def test_int4_code_views_match_torch(device: torch.device) -> None:
    """The decode kernels' INT4 unpackings (bytes -> low / high nibbles, int32 words ->
    channels in order, words -> per-byte nibbles) against torch's unpack_int4."""
    g = torch.Generator().manual_seed(4)
    rows, d = 4, 128
    codes = torch.randint(0, 16, (rows, d), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes).to(device)
    nat = torch.empty(rows, d, device=device)
    lo, hi, wl, wh = (
        torch.empty(rows, d // 2, dtype=torch.float16, device=device) for _ in range(4)
    )
    _int4_views_kernel[(1,)](packed, nat, lo, hi, wl, wh, R=rows, D=d)
    c = codes.to(device)
    assert torch.equal(nat, c.float())
    for even, odd in ((lo, hi), (wl, wh)):
        assert torch.equal(even.float(), c[:, 0::2].float())
        assert torch.equal(odd.float(), c[:, 1::2].float())


@triton.jit
def _int4_imma_views_kernel(
    p_ptr, lo_ptr, hi_ptr, wl_ptr, wh_ptr, R: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr
):
    r = tl.arange(0, R)
    ob = r[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    lo, hi = int4_code_bytes_i8(tl.load(p_ptr + ob), ASM)
    tl.store(lo_ptr + ob, lo)
    tl.store(hi_ptr + ob, hi)
    w = tl.load(
        p_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :]
    )
    c0, c1, c2, c3, c4, c5, c6, c7 = int4_word_codes_f16_subnormal(w, ASM)
    _store_word_codes(wl_ptr, wh_ptr, R, D, c0, c1, c2, c3, c4, c5, c6, c7)


def test_int4_imma_and_subnormal_code_views_match_torch(device: torch.device) -> None:
    """The int8 (bytes -> low / high nibbles as int8) and subnormal-fp16 (words -> n * 2**-24
    per byte nibble) unpackings of the int4_imma / int4_v_subnormal decode variants against
    torch's unpack_int4 (the inline PTX on a GPU, the fallback in the interpreter)."""
    g = torch.Generator().manual_seed(5)
    rows, d = 4, 128
    codes = torch.randint(0, 16, (rows, d), generator=g, dtype=torch.uint8)
    packed = pack_int4(codes).to(device)
    lo, hi = (torch.empty(rows, d // 2, dtype=torch.int8, device=device) for _ in range(2))
    wl, wh = (torch.empty(rows, d // 2, dtype=torch.float16, device=device) for _ in range(2))
    asm = not triton_interpreting()
    _int4_imma_views_kernel[(1,)](packed, lo, hi, wl, wh, R=rows, D=d, ASM=asm)
    c = codes.to(device)
    assert torch.equal(lo, c[:, 0::2].to(torch.int8))
    assert torch.equal(hi, c[:, 1::2].to(torch.int8))
    assert torch.equal(wl.float() * 2.0**24, c[:, 0::2].float())
    assert torch.equal(wh.float() * 2.0**24, c[:, 1::2].float())


@triton.jit
def _int4_word_codes_kernel(
    p_ptr,
    wl_ptr,
    wh_ptr,
    R: tl.constexpr,
    D: tl.constexpr,
    CENTRED: tl.constexpr,
    ASM: tl.constexpr,
):
    r = tl.arange(0, R)
    w = tl.load(
        p_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :]
    )
    c0, c1, c2, c3, c4, c5, c6, c7 = int4_word_codes_f16(w, ASM, CENTRED)
    _store_word_codes(wl_ptr, wh_ptr, R, D, c0, c1, c2, c3, c4, c5, c6, c7)


@pytest.mark.parametrize("centred", [False, True])
def test_int4_word_codes_magic_and_centred_match_torch(device: torch.device, centred) -> None:
    """The magic-number word unpacking (``n | 0x6400`` as fp16, minus 1024, or minus 1032 for
    the centred value codes of ``int4_v_centred``: n - 8) against torch's codes, exactly
    (the inline PTX on a GPU, the fallback in the interpreter)."""
    g = torch.Generator().manual_seed(6)
    rows, d = 4, 128
    codes = torch.randint(0, 16, (rows, d), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code once
    packed = pack_int4(codes).to(device)
    wl, wh = (torch.empty(rows, d // 2, dtype=torch.float16, device=device) for _ in range(2))
    asm = not triton_interpreting()
    _int4_word_codes_kernel[(1,)](packed, wl, wh, R=rows, D=d, CENTRED=centred, ASM=asm)
    c = codes.to(device).float() - (8.0 if centred else 0.0)
    assert torch.equal(wl.float(), c[:, 0::2])
    assert torch.equal(wh.float(), c[:, 1::2])


@triton.jit
def _int2_subnormal_views_kernel(
    p_ptr, q_ptr, w_ptr, R: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr
):
    Q: tl.constexpr = D // 4
    r = tl.arange(0, R)
    ob = r[:, None] * Q + tl.arange(0, Q)[None, :]
    u0, u1, u2, u3 = int2_code_quads_subnormal(tl.load(p_ptr + ob), ASM)
    oq = r[:, None] * D + tl.arange(0, Q)[None, :]  # channel block k at kQ
    tl.store(q_ptr + oq, u0)
    tl.store(q_ptr + oq + Q, u1)
    tl.store(q_ptr + oq + 2 * Q, u2)
    tl.store(q_ptr + oq + 3 * Q, u3)
    w = tl.load(
        p_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * (Q // 4) + tl.arange(0, Q // 4)[None, :]
    )
    x = int2_word_planes_f16(w, ASM)
    ow = r[:, None] * D + 4 * tl.arange(0, Q // 4)[None, :]  # output 4i + k: channel kQ + 4w + i
    tl.store(w_ptr + ow, x[0])
    tl.store(w_ptr + ow + Q, x[1])
    tl.store(w_ptr + ow + 2 * Q, x[2])
    tl.store(w_ptr + ow + 3 * Q, x[3])
    tl.store(w_ptr + ow + 1, x[4])
    tl.store(w_ptr + ow + 1 + Q, x[5])
    tl.store(w_ptr + ow + 1 + 2 * Q, x[6])
    tl.store(w_ptr + ow + 1 + 3 * Q, x[7])
    tl.store(w_ptr + ow + 2, x[8])
    tl.store(w_ptr + ow + 2 + Q, x[9])
    tl.store(w_ptr + ow + 2 + 2 * Q, x[10])
    tl.store(w_ptr + ow + 2 + 3 * Q, x[11])
    tl.store(w_ptr + ow + 3, x[12])
    tl.store(w_ptr + ow + 3 + Q, x[13])
    tl.store(w_ptr + ow + 3 + 2 * Q, x[14])
    tl.store(w_ptr + ow + 3 + 3 * Q, x[15])


@pytest.mark.parametrize("d", [64, 128])
def test_int2_subnormal_code_views_match_torch(d: int, device: torch.device) -> None:
    """The folded INT2 path's unpackings against torch's unpack_int2: bytes -> the four
    channel blocks as fp16 subnormals ``n 2**-24``, and int32 words -> each (byte, bit pair)
    left in place, ``(n << 2k) 2**-24`` for block k (the inline PTX on a GPU, the fallback in
    the interpreter)."""
    g = torch.Generator().manual_seed(6)
    rows = 4
    codes = torch.randint(0, 4, (rows, d), generator=g, dtype=torch.uint8)
    packed = pack_int2(codes).to(device)
    quads, planes = (torch.empty(rows, d, dtype=torch.float16, device=device) for _ in range(2))
    asm = not triton_interpreting()
    _int2_subnormal_views_kernel[(1,)](packed, quads, planes, R=rows, D=d, ASM=asm)
    c = codes.to(device).float()
    assert torch.equal(quads.float() * 2.0**24, c)
    shift = torch.arange(4, device=device).repeat_interleave(d // 4) * 2  # 2k of channel block k
    assert torch.equal(planes.float() * 2.0**24, c * torch.exp2(shift.float()))
