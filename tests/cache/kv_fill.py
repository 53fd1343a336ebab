"""Deterministic K/V content for store tests: each row encodes (token, position, layer, head),
so reading back proves that a slot was never reused while something still referenced it."""

from __future__ import annotations

import torch

from agentkv.cache import KVStore, RequestKV


def kv_value(tokens: torch.Tensor, positions: torch.Tensor, layer: int, H: int, D: int):
    """K rows ``[n, H, D]`` for ``tokens`` at ``positions`` (exact in float32); V is ``-K``."""
    base = (tokens.double() * 1024 + positions.double()) * 8 + layer
    k = base.view(-1, 1, 1) * 8 + torch.arange(H, dtype=torch.float64).view(1, -1, 1)
    return k.expand(-1, H, D).float()


def fill(store: KVStore, req: RequestKV, slots: torch.Tensor) -> None:
    """Write K/V of the positions ``slots`` were just allocated for (the last ``n``)."""
    n = int(slots.numel())
    pos = torch.arange(req.seq_len - n, req.seq_len)
    toks = torch.tensor(req.token_ids[req.seq_len - n : req.seq_len])
    H, D = store.pool.num_kv_heads, store.pool.head_dim
    for layer in range(store.num_layers):
        k = kv_value(toks, pos, layer, H, D)
        store.write_kv(layer, slots, k, -k)


def check_content(store: KVStore, req: RequestKV) -> None:
    """Every layer of ``req`` reads exactly the K/V of its own tokens at their positions."""
    H, D = store.pool.num_kv_heads, store.pool.head_dim
    toks = torch.tensor(req.token_ids[: req.seq_len], dtype=torch.int64)
    for layer in range(store.num_layers):
        k, v, pos, head_mask = store.read_kv(req, layer)
        want = kv_value(toks[pos], pos, layer, H, D)
        assert torch.equal(k, want), f"layer {layer}: K differs from what was written"
        assert torch.equal(v, -want)
        if head_mask is not None:
            assert torch.equal(head_mask, req.slot_map.keep_mask[layer][:, pos])
