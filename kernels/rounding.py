"""Rounding float32 values to a 16-bit float as torch's eager kernels do (to nearest even), the
same on the GPU and in Triton's interpreter.

The elementwise kernels that stand in for a chain of eager torch ops (:mod:`.rms_norm`,
:mod:`.rotary`, :mod:`.silu_mul`) round every intermediate the eager chain rounds, so that
their outputs equal the chain's. ``x.to(dtype).to(tl.float32)`` does not do that reliably:
Triton's interpreter truncates bfloat16, and on the GPU a float16 round trip was seen to
vanish (session 35: the rotary embedding 1 ulp off in many elements, as if the two products
were summed unrounded). :func:`round_to` rounds on the float32 bits instead, which neither
the compiler nor the interpreter can skip or do differently.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to nearest even in ``dtype`` (bfloat16, float16; float32 as
    is), returned as float32. Values beyond the 16-bit range come back past its largest
    finite value, so converting them to ``dtype`` gives the infinity eager rounding gives."""
    if dtype == tl.bfloat16:
        # keep 8 significant bits: add half the dropped part's range (ties to the even bit)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        # normal float16 (|x| >= 2^-14): keep 11 significant bits, as above
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + (0xFFF + ((bits >> 13) & 1))) & 0xFFFFE000).to(tl.float32, bitcast=True)
        # subnormal float16: a multiple of 2^-24, what adding 0.5 (ulp 2^-24) rounds to
        mag = tl.abs(x)
        tiny = (mag + 0.5) - 0.5
        tiny = tl.where(x < 0, -tiny, tiny)
        return tl.where(mag >= 6.103515625e-05, normal, tiny)
    else:
        return x
