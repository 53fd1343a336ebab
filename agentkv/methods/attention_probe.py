"""Explicit attention probabilities for scorers (SnapKV windows, H2O sums, IntentKV scores)."""

from __future__ import annotations

import math

import torch


def attention_probs(
    q: torch.Tensor,
    q_positions: torch.Tensor | None,
    k: torch.Tensor,
    k_positions: torch.Tensor | None,
    head_mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of queries over keys, float32.

    Args:
        q: ``[Hq, n, D]`` post-RoPE queries.
        q_positions: int64 ``[n]``; with ``k_positions`` (``[m]``) enables the causal mask
            (query ``i`` sees key ``j`` iff ``k_positions[j] <= q_positions[i]``). None: no
            causal mask.
        k: ``[Hkv, m, D]`` post-RoPE keys (``Hq`` a multiple of ``Hkv``).
        head_mask: bool ``[Hkv, m]``, False = that KV head no longer has that key.
        key_mask: bool ``[m]``, False = key excluded for every head.

    Returns:
        float32 ``[Hq, n, m]``, rows summing to 1 over visible keys (all-zero rows when a
        query sees no key).
    """
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=0)
    logits = torch.matmul(q.float(), kf.transpose(1, 2)) / math.sqrt(q.shape[-1])
    visible = torch.ones(logits.shape[1:], dtype=torch.bool, device=logits.device)
    if q_positions is not None and k_positions is not None:
        visible = k_positions[None, :] <= q_positions[:, None]
    visible = visible[None].expand(hq, -1, -1)
    if head_mask is not None:
        visible = visible & head_mask.repeat_interleave(g, dim=0)[:, None, :]
    if key_mask is not None:
        visible = visible & key_mask[None, None, :]
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
