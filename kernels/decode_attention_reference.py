"""Pure-torch reference of the fused mixed-precision decode attention (also the CPU path).

Dequantizes every position of the slot map (per-token pool dispatch by slot id, so it does
not rely on the INT2 / INT4 / full segment order that the Triton kernel needs), masks DEAD
positions by id, positions past ``seq_lens`` and, optionally, per-KV-head masked
positions, and runs a float32 softmax attention. A row with nothing live returns zeros.
"""

from __future__ import annotations

import math

import torch

from .dequant_gather import dequant_gather_ref
from .pools import DEAD, KVPools


def decode_attention_ref(
    q: torch.Tensor,
    pools: KVPools,
    slot_map: torch.Tensor,
    seq_lens: torch.Tensor,
    head_mask: torch.Tensor | None = None,
    sm_scale: float | None = None,
    dead_id: int = DEAD,
) -> torch.Tensor:
    """q: [B, Hq, D]; slot_map: [B, L] unified slot ids, or [B, Hkv, L] per-KV-head maps;
    seq_lens: [B] (or [B, Hkv]); head_mask: [B, Hkv, L] bool (True = attend) or None.
    Returns [B, Hq, D] in q's dtype."""
    b, hq, d = q.shape
    hkv = pools.num_kv_heads
    g = hq // hkv
    length = slot_map.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    pos = torch.arange(length, device=slot_map.device)
    per_head = slot_map.dim() == 3
    sm = slot_map if per_head else slot_map[:, None, :].expand(b, hkv, length)
    lens = seq_lens.long()
    lens = lens.expand(b, hkv) if lens.dim() == 2 else lens[:, None].expand(b, hkv)
    live = (pos[None, None, :] < lens[:, :, None]) & (sm != dead_id)  # [B, Hkv, L]
    slots = torch.where(live, sm, torch.full_like(sm, dead_id))  # never read padding
    k, v = dequant_gather_ref(  # [B, L, Hkv, D]
        pools, slots.transpose(1, 2), dead_id, torch.float32, per_head=True
    )
    if head_mask is not None:
        live = live & head_mask.bool()
    qg = q.float().reshape(b, hkv, g, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~live[:, :, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhgl,blhd->bhgd", p, v)
    return out.reshape(b, hq, d).to(q.dtype)
