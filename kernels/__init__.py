"""agentkv.kernels: Triton kernels for mixed-precision, dead-slot-aware KV caches, each with
a pure-torch reference beside it (the CPU path).

Engine-facing API (one layer at a time):

* :class:`KVPools` (``FullPool`` + ``Int4Pool`` + ``Int2Pool``): pool tensors and the
  unified slot-id address space; ``DEAD = 0`` is the eviction sentinel slot.
* :func:`write_int4` - quantize token rows (K and V, per token, 32-channel groups) into
  INT4 slots.
* :func:`write_int2_pages` - quantize whole 32-token pages (K per channel over the page,
  V per token) into INT2 pages.
* :func:`dequant_gather` - gather + dequantize any mix of slots into dense K/V (prefill);
  tuning knobs in :class:`GatherConfig` (``GATHER_BASE``: the original kernel).
* :func:`decode_attention` - fused flash-decoding over INT2 | INT4 | full segments with
  DEAD masking by id, GQA, variable lengths and optional per-KV-head masks.
* :func:`rms_norm` - the Llama-family RMSNorm in one kernel (the engine's norms on CUDA).
* :func:`apply_rotary` - a layer's rotary embedding of queries and keys in one kernel.
* :func:`silu_mul` - the gated MLP's ``silu(gate) * up`` over one stacked projection.
* :func:`write_full` - a layer's new K and V rows into their full-precision cells.

Every function takes ``backend="auto" | "triton" | "torch"``; auto runs Triton on CUDA
tensors or under ``TRITON_INTERPRET=1`` and the torch reference otherwise. This package
imports nothing else from agentkv.
"""

from .backend import Backend, resolve_backend
from .decode_attention import (
    DecodeConfig,
    SegmentMaxLens,
    clear_decode_plans,
    decode_attention,
    held_decode_plans,
    plan_split_len,
    validate_decode_inputs,
)
from .decode_attention_reference import decode_attention_ref
from .dequant_gather import GATHER_BASE, GatherConfig, dequant_gather, dequant_gather_ref
from .pools import (
    DEAD,
    GROUP_SIZE,
    INT2_PAGE,
    SCALE_DTYPE,
    FullPool,
    Int2Pool,
    Int4Pool,
    Int4RowMap,
    KVPools,
    check_head_dim,
)
from .quant_int2 import (
    dequantize_int2_keys_ref,
    dequantize_int2_values_ref,
    quantize_int2_keys_ref,
    quantize_int2_values_ref,
    write_int2_pages,
    write_int2_pages_ref,
)
from .quant_int4 import dequantize_int4_ref, quantize_int4_ref, write_int4, write_int4_ref
from .rms_norm import rms_norm, rms_norm_ref
from .rotary import apply_rotary, apply_rotary_ref
from .silu_mul import silu_mul, silu_mul_ref
from .write_full import write_full, write_full_ref

__all__ = [
    "DEAD",
    "GATHER_BASE",
    "GROUP_SIZE",
    "INT2_PAGE",
    "SCALE_DTYPE",
    "Backend",
    "DecodeConfig",
    "FullPool",
    "GatherConfig",
    "Int2Pool",
    "Int4Pool",
    "Int4RowMap",
    "KVPools",
    "SegmentMaxLens",
    "apply_rotary",
    "apply_rotary_ref",
    "check_head_dim",
    "clear_decode_plans",
    "held_decode_plans",
    "decode_attention",
    "decode_attention_ref",
    "dequant_gather",
    "dequant_gather_ref",
    "dequantize_int2_keys_ref",
    "dequantize_int2_values_ref",
    "dequantize_int4_ref",
    "plan_split_len",
    "quantize_int2_keys_ref",
    "quantize_int2_values_ref",
    "quantize_int4_ref",
    "resolve_backend",
    "rms_norm",
    "rms_norm_ref",
    "silu_mul",
    "silu_mul_ref",
    "validate_decode_inputs",
    "write_int2_pages",
    "write_int2_pages_ref",
    "write_full",
    "write_full_ref",
    "write_int4",
    "write_int4_ref",
]
