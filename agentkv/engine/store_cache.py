"""transformers integration: a ``Cache`` backed by the KV store + the ``agentkv`` attention.

One forward pass of the embedded engine computes ``n`` new positions of one request:

- :class:`StoreCache.update` (called by every attention layer with the new post-RoPE K/V)
  writes them into the request's slots in the pool, then returns the K/V of every position the
  layer still attends to (DEAD dropped, keys past the chunk cut off), remembering their
  logical positions and per-head mask;
- :func:`agentkv_attention` (registered with transformers' ``AttentionInterface`` as
  ``"agentkv"``) builds the causal mask from logical positions, not from indices, so holes
  left by eviction are invisible, applies per-KV-head masks, and feeds the method's prefill
  observer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from agentkv.cache import KVStore, RequestKV
from agentkv.methods import PrefillObserver

ATTN_NAME = "agentkv"
CACHE_KWARG = "agentkv_cache"


class StoreCache(Cache):
    """A transformers ``Cache`` for one forward pass over the KV store.

    Args:
        store: the engine's KV store.
        req: the request being computed.
        write_slots: int64 ``[n]`` slots of the new positions (from ``KVStore.extend``).
        positions: int64 ``[n]`` logical positions of the new tokens (ascending).
        observer: the method's prefill observer, or None.
    """

    is_compileable = False

    def __init__(
        self,
        store: KVStore,
        req: RequestKV,
        write_slots: torch.Tensor,
        positions: torch.Tensor,
        observer: PrefillObserver | None = None,
    ):
        super().__init__(layers=[])
        self.store = store
        self.req = req
        self.write_slots = write_slots.to(store.pool.device)
        self.positions = positions.to(store.pool.device)
        self.observer = observer
        self.key_positions: dict[int, torch.Tensor] = {}
        self.head_masks: dict[int, torch.Tensor | None] = {}
        #: keys each layer attended (summed over layers), for the effective-reads metric.
        self.attended_keys = 0.0

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states``/``value_states`` ``[1, Hkv, n, D]`` -> attended K/V ``[1, Hkv, m, D]``."""
        k_new = key_states[0].transpose(0, 1)
        v_new = value_states[0].transpose(0, 1)
        self.store.write_kv(layer_idx, self.write_slots, k_new, v_new)
        k, v, pos, head_mask = self.store.read_kv(self.req, layer_idx)
        end = int(torch.searchsorted(pos, self.positions[-1], right=True))
        k, v, pos = k[:end], v[:end], pos[:end]
        if head_mask is not None:
            head_mask = head_mask[:, :end]
            self.attended_keys += float(head_mask.float().mean()) * end
        else:
            self.attended_keys += end
        self.key_positions[layer_idx] = pos
        self.head_masks[layer_idx] = head_mask
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.positions[-1]) + 1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1


def agentkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the store's live keys.

    ``query`` ``[1, Hq, n, D]``; ``key``/``value`` ``[1, Hkv, m, D]`` as returned by
    :meth:`StoreCache.update`. Returns ``([1, n, Hq, D], None)`` like transformers' SDPA path.
    """
    cache: StoreCache | None = kwargs.get(CACHE_KWARG)
    if cache is None:
        raise RuntimeError(
            "the agentkv attention runs only inside the agentkv engine (no StoreCache given)"
        )
    layer = module.layer_idx
    k_pos = cache.key_positions[layer]
    head_mask = cache.head_masks[layer]
    hq, hkv = query.shape[1], key.shape[1]
    group = hq // hkv
    mask = k_pos[None, :] <= cache.positions[:, None]  # [n, m]
    if head_mask is not None:
        mask = mask[None] & head_mask.repeat_interleave(group, dim=0)[:, None, :]  # [Hq, n, m]
    if cache.observer is not None:
        cache.observer.observe(layer, query[0], cache.positions, key[0], k_pos, head_mask)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask if mask.ndim == 3 else mask[None],
        scale=scaling,
        enable_gqa=group > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register :func:`agentkv_attention` as transformers attention implementation ``agentkv``."""
    AttentionInterface.register(ATTN_NAME, agentkv_attention)
