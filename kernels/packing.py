"""Bit layouts of packed INT4 / INT2 codes in uint8 buffers (torch and Triton versions).

INT4: byte ``j`` holds channel ``2j`` (low nibble) and ``2j+1`` (high nibble).
INT2 (planar): byte ``j`` of a D-channel row holds channel ``j + i * D / 4`` at bits
``2i .. 2i+1`` for i = 0..3, so unpacking bit pair i of every byte yields the contiguous
channel block ``[i * D / 4, (i + 1) * D / 4)``.

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
    """[..., D] integer codes in 0..3 -> [..., D // 4] uint8 (planar layout)."""
    c = codes.to(torch.uint8)
    q = c.shape[-1] // 4
    return (
        c[..., :q]
        | (c[..., q : 2 * q] << 2)
        | (c[..., 2 * q : 3 * q] << 4)
        | (c[..., 3 * q :] << 6)
    )


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """[..., D // 4] uint8 -> [..., D] uint8 codes in 0..3 (planar layout)."""
    return torch.cat([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)


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
def unpack_int4_words_f32(w, R: tl.constexpr, W: tl.constexpr):
    """[R, W] int32 words of INT4 bytes -> [R, 8 W] float32 codes in natural channel order
    (byte k of a word holds channels 2k, 2k + 1, so nibble i of word w is channel 8w + i)."""
    sh = 4 * tl.arange(0, 8)
    u = (w[:, :, None] >> sh[None, None, :]) & 15
    return tl.reshape(codes_to_f32(u), [R, 8 * W])


@triton.jit
def unpack_int2_f32(b):
    """[R, D // 4] uint8 -> four [R, D // 4] float32 code blocks: channels
    ``[i * D / 4, (i + 1) * D / 4)`` for i = 0..3."""
    x = b.to(tl.int32)
    return (
        codes_to_f32(x & 3),
        codes_to_f32((x >> 2) & 3),
        codes_to_f32((x >> 4) & 3),
        codes_to_f32(x >> 6),
    )


@triton.jit
def pack_int4_u8(u, R: tl.constexpr, D: tl.constexpr):
    """[R, D] int32 codes in 0..15 -> [R, D // 2] uint8."""
    lo, hi = tl.split(tl.reshape(u, [R, D // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def pack_int2_u8(u, R: tl.constexpr, D: tl.constexpr):
    """[R, D] int32 codes in 0..3 -> [R, D // 4] uint8 (planar layout)."""
    t = tl.permute(tl.reshape(u, [R, 2, 2, D // 4]), (0, 3, 2, 1))  # [r, j, i0, i1]
    e0, e1 = tl.split(t)  # i1 = 0 -> blocks 0, 1; i1 = 1 -> blocks 2, 3
    c0, c1 = tl.split(e0)
    c2, c3 = tl.split(e1)
    return (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8)


# --- packed register dequantization for the decode kernel ------------------------------------
# Codes become 16-bit floats with the magic-exponent trick: (code | 0x4300) as bf16 is
# 128 + code (0x6400 as fp16: 1024 + code), the offset is removed exactly by one fma, and a
# second fma applies scale and zero: two elements per instruction (bf16x2 / f16x2). The torch
# layout stays the one documented above; outputs come as channel subsets (even / odd
# channels for INT4, channels 4j+i for INT2) so no shuffle is needed before a tl.dot.


def _int4_pairs_asm(fp: str, magic: str, one: str, neg: str) -> str:
    # $0,$1 even-channel pairs; $2,$3 odd-channel pairs; $4 four code bytes;
    # $5,$6 scale pairs; $7,$8 zero pairs (pack = 4 elements per call).
    return f"""{{
    .reg .b32 zz, t01, t23, u0, u1, u2, u3, k1, kn;
    mov.b32 zz, 0;
    mov.b32 k1, {one};
    mov.b32 kn, {neg};
    prmt.b32 t01, $4, zz, 0x4140;
    prmt.b32 t23, $4, zz, 0x4342;
    lop3.b32 u0, t01, 0x000F000F, {magic}, 0xEA;
    lop3.b32 u1, t23, 0x000F000F, {magic}, 0xEA;
    shr.b32 t01, t01, 4;
    shr.b32 t23, t23, 4;
    lop3.b32 u2, t01, 0x000F000F, {magic}, 0xEA;
    lop3.b32 u3, t23, 0x000F000F, {magic}, 0xEA;
    fma.rn.{fp} u0, u0, k1, kn;
    fma.rn.{fp} u1, u1, k1, kn;
    fma.rn.{fp} u2, u2, k1, kn;
    fma.rn.{fp} u3, u3, k1, kn;
    fma.rn.{fp} $0, u0, $5, $7;
    fma.rn.{fp} $1, u1, $6, $8;
    fma.rn.{fp} $2, u2, $5, $7;
    fma.rn.{fp} $3, u3, $6, $8;
    }}"""


def _int2_quads_asm(fp: str, magic: str, one: str, neg: str, mode: str) -> str:
    # $2i,$2i+1: pairs of output i (bits 2i..2i+1 of each byte); $8 four code bytes.
    # mode "codes": exact codes (magic number, offset removed by an fma); "dequant": output i
    # also uses scale pairs $9+4i,$10+4i and zero pairs $11+4i,$12+4i; "subnormal": the code
    # itself is the bit pattern, the fp16 subnormal n * 2**-24 (no magic number, no fma).
    lines = [
        "{",
        ".reg .b32 zz, t01, t23, u0, u1, k1, kn;",
        "mov.b32 zz, 0;",
        f"mov.b32 k1, {one};",
        f"mov.b32 kn, {neg};",
        "prmt.b32 t01, $8, zz, 0x4140;",
        "prmt.b32 t23, $8, zz, 0x4342;",
    ]
    for i in range(4):
        if mode == "subnormal":
            lines += [
                f"and.b32 ${2 * i}, t01, 0x00030003;",
                f"and.b32 ${2 * i + 1}, t23, 0x00030003;",
            ]
        else:
            lines += [
                f"lop3.b32 u0, t01, 0x00030003, {magic}, 0xEA;",
                f"lop3.b32 u1, t23, 0x00030003, {magic}, 0xEA;",
            ]
        if mode == "dequant":
            s0, s1, z0, z1 = 9 + 4 * i, 10 + 4 * i, 11 + 4 * i, 12 + 4 * i
            lines += [
                f"fma.rn.{fp} u0, u0, k1, kn;",
                f"fma.rn.{fp} u1, u1, k1, kn;",
                f"fma.rn.{fp} ${2 * i}, u0, ${s0}, ${z0};",
                f"fma.rn.{fp} ${2 * i + 1}, u1, ${s1}, ${z1};",
            ]
        elif mode == "codes":
            lines += [
                f"fma.rn.{fp} ${2 * i}, u0, k1, kn;",
                f"fma.rn.{fp} ${2 * i + 1}, u1, k1, kn;",
            ]
        if i < 3:
            lines += ["shr.b32 t01, t01, 2;", "shr.b32 t23, t23, 2;"]
    lines.append("}")
    return "\n".join(lines)


def _int4_codes_asm(fp: str, magic: str, one: str, neg: str) -> str:
    # $0,$1 low-nibble code pairs; $2,$3 high-nibble code pairs; $4 four code bytes. The
    # magic offset (1024 / 128) is removed by the fma *before* any dot, so the codes are
    # exact small integers (subtracting it after the dot loses precision).
    return f"""{{
    .reg .b32 zz, t01, t23, u0, u1, u2, u3, k1, kn;
    mov.b32 zz, 0;
    mov.b32 k1, {one};
    mov.b32 kn, {neg};
    prmt.b32 t01, $4, zz, 0x4140;
    prmt.b32 t23, $4, zz, 0x4342;
    lop3.b32 u0, t01, 0x000F000F, {magic}, 0xEA;
    lop3.b32 u1, t23, 0x000F000F, {magic}, 0xEA;
    shr.b32 t01, t01, 4;
    shr.b32 t23, t23, 4;
    lop3.b32 u2, t01, 0x000F000F, {magic}, 0xEA;
    lop3.b32 u3, t23, 0x000F000F, {magic}, 0xEA;
    fma.rn.{fp} $0, u0, k1, kn;
    fma.rn.{fp} $1, u1, k1, kn;
    fma.rn.{fp} $2, u2, k1, kn;
    fma.rn.{fp} $3, u3, k1, kn;
    }}"""


_BF16 = ("bf16x2", "0x43004300", "0x3F803F80", "0xC300C300")
_FP16 = ("f16x2", "0x64006400", "0x3C003C00", "0xE400E400")
INT4_PAIRS_BF16 = tl.constexpr(_int4_pairs_asm(*_BF16))
INT4_PAIRS_FP16 = tl.constexpr(_int4_pairs_asm(*_FP16))
INT4_CODES_BF16 = tl.constexpr(_int4_codes_asm(*_BF16))
INT4_CODES_FP16 = tl.constexpr(_int4_codes_asm(*_FP16))
INT2_CODES_BF16 = tl.constexpr(_int2_quads_asm(*_BF16, mode="codes"))
INT2_CODES_FP16 = tl.constexpr(_int2_quads_asm(*_FP16, mode="codes"))
INT2_QUADS_BF16 = tl.constexpr(_int2_quads_asm(*_BF16, mode="dequant"))
INT2_QUADS_FP16 = tl.constexpr(_int2_quads_asm(*_FP16, mode="dequant"))
INT2_QUADS_SUBNORMAL = tl.constexpr(_int2_quads_asm(*_FP16, mode="subnormal"))
#: 2**-24, the fp16 subnormal whose bit pattern is 1: a code n stored as the bits of an
#: fp16 is n * SUBNORMAL_UNIT (the interpreter fallbacks compute it so)
SUBNORMAL_UNIT = tl.constexpr(2.0**-24)


@triton.jit
def dequant_int4_pairs(b, s, z, USE_ASM: tl.constexpr):
    """b: [R, C] uint8 INT4 bytes; s, z: [R, C] bf16 or fp16 scale / zero of each byte's
    group. Returns (even, odd) channel values ``code * s + z``, each [R, C] in s's dtype."""
    if USE_ASM:
        if s.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(
                INT4_PAIRS_BF16,
                "=r,=r,=r,=r,r,r,r,r,r",
                [b, s, z],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
        else:
            return tl.inline_asm_elementwise(
                INT4_PAIRS_FP16,
                "=r,=r,=r,=r,r,r,r,r,r",
                [b, s, z],
                dtype=(tl.float16, tl.float16),
                is_pure=True,
                pack=4,
            )
    else:
        x = b.to(tl.int32)
        sf = s.to(tl.float32)
        zf = z.to(tl.float32)
        even = (codes_to_f32(x & 15) * sf + zf).to(s.dtype)
        odd = (codes_to_f32(x >> 4) * sf + zf).to(s.dtype)
        return even, odd


@triton.jit
def int4_code_pairs(b, OUT: tl.constexpr, USE_ASM: tl.constexpr):
    """b: [R, C] uint8 INT4 bytes -> (low, high) nibble codes, each [R, C] of dtype OUT
    (bf16 / fp16 / fp32), exact integers 0..15 (magic-number conversion, offset removed)."""
    if USE_ASM and OUT == tl.bfloat16:  # noqa: SIM300
        return tl.inline_asm_elementwise(
            INT4_CODES_BF16,
            "=r,=r,=r,=r,r",
            [b],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    elif USE_ASM and OUT == tl.float16:  # noqa: SIM300
        return tl.inline_asm_elementwise(
            INT4_CODES_FP16,
            "=r,=r,=r,=r,r",
            [b],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        x = b.to(tl.int32)
        return codes_to_f32(x & 15).to(OUT), codes_to_f32(x >> 4).to(OUT)


# int4 -> int8 for the integer tensor cores: four code bytes in one register give the four
# low nibbles (channels 2j) and the four high nibbles (channels 2j + 1) as int8 lanes with
# one and, one shift and one and; no conversion at all.
INT4_CODES_I8 = tl.constexpr(
    "{ .reg .b32 t; and.b32 $0, $2, 0x0F0F0F0F; shr.b32 t, $2, 4; and.b32 $1, t, 0x0F0F0F0F; }"
)


@triton.jit
def int4_code_bytes_i8(b, USE_ASM: tl.constexpr):
    """b: [R, C] uint8 INT4 bytes -> (low, high) nibble codes, each [R, C] int8 (0..15):
    the even and odd channels of the bytes, packed four to a register (IMMA operands)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            INT4_CODES_I8,
            "=r,=r,r",
            [b],
            dtype=(tl.int8, tl.int8),
            is_pure=True,
            pack=4,
        )
    else:
        return (b & 15).to(tl.int8), (b >> 4).to(tl.int8)


def _int4_word_codes_asm(centre: int = 0) -> str:
    # $8, $9: two int32 words (bytes 0..3 each); outputs $0..$3: low nibbles of byte k of
    # both words (f16x2: word 0 in the low half), $4..$7: their high nibbles. Exact codes
    # n - centre: ``n | 0x6400`` is the fp16 1024 + n, the fma adds -(1024 + centre).
    minus = 0xE400 + centre  # the fp16 -(1024 + centre) for 0 <= centre < 1024
    lines = [
        "{",
        ".reg .b32 t, u, k1, kn;",
        "mov.b32 k1, 0x3C003C00;",
        f"mov.b32 kn, {minus | (minus << 16):#010x};",
    ]
    for k in range(4):
        sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)
        lines += [
            f"prmt.b32 t, $8, $9, {sel:#06x};",
            "lop3.b32 u, t, 0x000F000F, 0x64006400, 0xEA;",
            f"fma.rn.f16x2 ${k}, u, k1, kn;",
            "shr.b32 t, t, 4;",
            "lop3.b32 u, t, 0x000F000F, 0x64006400, 0xEA;",
            f"fma.rn.f16x2 ${4 + k}, u, k1, kn;",
        ]
    lines.append("}")
    return "\n".join(lines)


INT4_WORD_CODES = tl.constexpr(_int4_word_codes_asm())
#: the value codes' centre of ``int4_v_centred``: a code n enters the dot as n - 8
INT4_CENTRE = tl.constexpr(8)
INT4_WORD_CODES_CENTRED = tl.constexpr(_int4_word_codes_asm(INT4_CENTRE.value))


def _int4_word_codes_subnormal_asm() -> str:
    # as _int4_word_codes_asm, but a nibble n in the low bits of an fp16 is the subnormal
    # n * 2**-24, exactly: no magic number and no fma (the 2**24 is applied after the dot)
    lines = ["{", ".reg .b32 t;"]
    for k in range(4):
        sel = k | (k << 4) | ((4 + k) << 8) | ((4 + k) << 12)
        lines += [
            f"prmt.b32 t, $8, $9, {sel:#06x};",
            f"and.b32 ${k}, t, 0x000F000F;",
            "shr.b32 t, t, 4;",
            f"and.b32 ${4 + k}, t, 0x000F000F;",
        ]
    lines.append("}")
    return "\n".join(lines)


INT4_WORD_CODES_SUBNORMAL = tl.constexpr(_int4_word_codes_subnormal_asm())


@triton.jit
def _int4_word_nibbles_asm(w, ASM: tl.constexpr):
    """The eight fp16 outputs of one of the INT4 word PTX programs (``INT4_WORD_CODES*``)
    over w: [R, W] int32 words."""
    return tl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 8, is_pure=True, pack=2
    )


@triton.jit
def _int4_word_nibbles_f32(w):
    """w: [R, W] int32 words -> the eight nibble tensors in the PTX programs' order (low
    nibble of byte k for k = 0..3, then the high nibbles), exact fp32 (interpreter path)."""
    return (
        codes_to_f32(w & 15),
        codes_to_f32((w >> 8) & 15),
        codes_to_f32((w >> 16) & 15),
        codes_to_f32((w >> 24) & 15),
        codes_to_f32((w >> 4) & 15),
        codes_to_f32((w >> 12) & 15),
        codes_to_f32((w >> 20) & 15),
        codes_to_f32((w >> 28) & 15),
    )


@triton.jit
def int4_word_codes_f16(w, USE_ASM: tl.constexpr, CENTRED: tl.constexpr):
    """w: [R, W] int32 words of INT4 bytes -> eight [R, W] fp16 tensors of exact codes:
    (low nibble of byte k for k = 0..3, then high nibble of byte k for k = 0..3) of each
    word. With the pool's layout, word i of a 32-channel group holds channels 8i .. 8i + 7:
    low nibble of byte k = channel 8i + 2k, high nibble = channel 8i + 2k + 1. CENTRED:
    each code n comes as n - ``INT4_CENTRE`` (-8 .. 7; exact, same instruction count)."""
    if USE_ASM:
        if CENTRED:  # (a conditional expression over the two strings fails in Triton 3.6)
            return _int4_word_nibbles_asm(w, INT4_WORD_CODES_CENTRED)
        else:
            return _int4_word_nibbles_asm(w, INT4_WORD_CODES)
    else:
        c = 0.0
        if CENTRED:
            c = INT4_CENTRE * 1.0
        n0, n1, n2, n3, n4, n5, n6, n7 = _int4_word_nibbles_f32(w)
        return (
            (n0 - c).to(tl.float16),
            (n1 - c).to(tl.float16),
            (n2 - c).to(tl.float16),
            (n3 - c).to(tl.float16),
            (n4 - c).to(tl.float16),
            (n5 - c).to(tl.float16),
            (n6 - c).to(tl.float16),
            (n7 - c).to(tl.float16),
        )


@triton.jit
def int4_word_codes_f16_subnormal(w, USE_ASM: tl.constexpr):
    """As :func:`int4_word_codes_f16` (same eight tensors, same channels), but each code n
    comes as the fp16 subnormal ``n * 2**-24`` (exact; the tensor cores multiply fp16
    subnormals exactly into their fp32 accumulators): two integer ops per two codes."""
    if USE_ASM:
        return _int4_word_nibbles_asm(w, INT4_WORD_CODES_SUBNORMAL)
    else:
        t = SUBNORMAL_UNIT
        n0, n1, n2, n3, n4, n5, n6, n7 = _int4_word_nibbles_f32(w)
        return (
            (n0 * t).to(tl.float16),
            (n1 * t).to(tl.float16),
            (n2 * t).to(tl.float16),
            (n3 * t).to(tl.float16),
            (n4 * t).to(tl.float16),
            (n5 * t).to(tl.float16),
            (n6 * t).to(tl.float16),
            (n7 * t).to(tl.float16),
        )


@triton.jit
def _int2_quads_f16_asm(b, ASM: tl.constexpr):
    """The four fp16 outputs of one of the fp16 INT2 quad PTX programs over b: [R, C] uint8
    (Triton 3.6 cannot take the output dtype as a constexpr argument here)."""
    return tl.inline_asm_elementwise(
        ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [b], dtype=(tl.float16,) * 4, is_pure=True, pack=4
    )


@triton.jit
def int2_code_quads(b, OUT: tl.constexpr, USE_ASM: tl.constexpr):
    """b: [R, C] uint8 INT2 bytes -> 4 tensors [R, C] of dtype OUT (bf16 / fp16) holding the
    exact codes of channels 4j+0 .. 4j+3."""
    if USE_ASM:
        if OUT == tl.bfloat16:  # noqa: SIM300
            return tl.inline_asm_elementwise(
                INT2_CODES_BF16,
                "=r,=r,=r,=r,=r,=r,=r,=r,r",
                [b],
                dtype=(tl.bfloat16,) * 4,
                is_pure=True,
                pack=4,
            )
        else:
            return _int2_quads_f16_asm(b, INT2_CODES_FP16)
    else:
        x = b.to(tl.int32)
        c0 = codes_to_f32(x & 3).to(OUT)
        c1 = codes_to_f32((x >> 2) & 3).to(OUT)
        c2 = codes_to_f32((x >> 4) & 3).to(OUT)
        c3 = codes_to_f32(x >> 6).to(OUT)
        return c0, c1, c2, c3


@triton.jit
def int2_code_quads_subnormal(b, USE_ASM: tl.constexpr):
    """As :func:`int2_code_quads` with OUT fp16 (same four tensors, same channels), but each
    code n comes as the fp16 subnormal ``n * 2**-24`` (exact; the tensor cores multiply fp16
    subnormals exactly into fp32): one integer op per code, the 2**24 applied after the dot."""
    if USE_ASM:
        return _int2_quads_f16_asm(b, INT2_QUADS_SUBNORMAL)
    else:
        t = SUBNORMAL_UNIT
        x = b.to(tl.int32)
        return (
            (codes_to_f32(x & 3) * t).to(tl.float16),
            (codes_to_f32((x >> 2) & 3) * t).to(tl.float16),
            (codes_to_f32((x >> 4) & 3) * t).to(tl.float16),
            (codes_to_f32(x >> 6) * t).to(tl.float16),
        )


def _int2_word_planes_asm() -> str:
    # $16, $17: two int32 words of INT2 bytes (the same word of two consecutive tokens);
    # output 4 i + k ($0..$15): f16x2 (token of $16 in the low half) of bit pair k of byte i,
    # left in place: the fp16 subnormal (n << 2k) * 2**-24, exact (the 2**-2k is undone by
    # the caller). One byte permute per byte, one and per plane: no shift.
    lines = ["{", ".reg .b32 t;"]
    for i in range(4):
        sel = i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12)
        lines.append(f"prmt.b32 t, $16, $17, {sel:#06x};")
        for k in range(4):
            mask = (3 << (2 * k)) * 0x00010001
            lines.append(f"and.b32 ${4 * i + k}, t, {mask:#010x};")
    lines.append("}")
    return "\n".join(lines)


INT2_WORD_PLANES = tl.constexpr(_int2_word_planes_asm())


@triton.jit
def _int2_plane_in_place(x, i: tl.constexpr, k: tl.constexpr):
    """Bit pair k of byte i of int32 words x, left in place, as the fp16 ``(n << 2k) 2**-24``."""
    return (codes_to_f32((x >> (8 * i)) & (3 << (2 * k))) * SUBNORMAL_UNIT).to(tl.float16)


@triton.jit
def int2_word_planes_f16(w, USE_ASM: tl.constexpr):
    """w: [R, W] int32 words of INT2 bytes (planar layout) -> sixteen [R, W] fp16 tensors,
    index ``4 i + k``: the code of bit pair k (channel block k) of byte i of each word, as the
    fp16 subnormal ``(n << 2k) * 2**-24`` (exact; scale the dot's result by ``2**(24 - 2k)``).
    Word w of a row holds bytes 4w .. 4w + 3, so output 4 i + k is channel ``kQ + 4w + i``
    (Q = D / 4). Paired over two words of consecutive rows (an MMA operand's K pairs)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            INT2_WORD_PLANES,
            "=r," * 16 + "r,r",
            [w],
            dtype=(tl.float16,) * 16,
            is_pure=True,
            pack=2,
        )
    else:
        return (
            _int2_plane_in_place(w, 0, 0),
            _int2_plane_in_place(w, 0, 1),
            _int2_plane_in_place(w, 0, 2),
            _int2_plane_in_place(w, 0, 3),
            _int2_plane_in_place(w, 1, 0),
            _int2_plane_in_place(w, 1, 1),
            _int2_plane_in_place(w, 1, 2),
            _int2_plane_in_place(w, 1, 3),
            _int2_plane_in_place(w, 2, 0),
            _int2_plane_in_place(w, 2, 1),
            _int2_plane_in_place(w, 2, 2),
            _int2_plane_in_place(w, 2, 3),
            _int2_plane_in_place(w, 3, 0),
            _int2_plane_in_place(w, 3, 1),
            _int2_plane_in_place(w, 3, 2),
            _int2_plane_in_place(w, 3, 3),
        )


@triton.jit
def dequant_int2_quads(b, s0, z0, s1, z1, s2, z2, s3, z3, USE_ASM: tl.constexpr):
    """b: [R, C] uint8 INT2 bytes (planar); s_i, z_i: [R, C] bf16 / fp16 scale / zero for
    output i -> 4 tensors [R, C]: ``code_i * s_i + z_i`` (channel block i)."""
    if USE_ASM:
        if s0.dtype == tl.bfloat16:
            return tl.inline_asm_elementwise(
                INT2_QUADS_BF16,
                "=r,=r,=r,=r,=r,=r,=r,=r," + "r," * 16 + "r",
                [b, s0, z0, s1, z1, s2, z2, s3, z3],
                dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
        else:
            return tl.inline_asm_elementwise(
                INT2_QUADS_FP16,
                "=r,=r,=r,=r,=r,=r,=r,=r," + "r," * 16 + "r",
                [b, s0, z0, s1, z1, s2, z2, s3, z3],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True,
                pack=4,
            )
    else:
        x = b.to(tl.int32)
        v0 = (codes_to_f32(x & 3) * s0.to(tl.float32) + z0.to(tl.float32)).to(s0.dtype)
        v1 = (codes_to_f32((x >> 2) & 3) * s1.to(tl.float32) + z1.to(tl.float32)).to(s0.dtype)
        v2 = (codes_to_f32((x >> 4) & 3) * s2.to(tl.float32) + z2.to(tl.float32)).to(s0.dtype)
        v3 = (codes_to_f32(x >> 6) * s3.to(tl.float32) + z3.to(tl.float32)).to(s0.dtype)
        return v0, v1, v2, v3
