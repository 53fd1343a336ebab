"""Per-layer token-slot KV buffers.

The counterpart of SGLang's ``MHATokenToKVPool``: for each layer one key and one value buffer
of shape ``[num_slots, num_kv_heads, head_dim]``; a row (slot) holds all KV heads of one
token. Row 0 is the dead slot: zero-filled, never written, never read by attention.
"""

from __future__ import annotations

import torch

from agentkv.cache.dead_slot import DEAD


class KVPool:
    """Key and value buffers, one pair per layer.

    Args:
        num_layers: transformer layers ``L``.
        num_slots: rows per buffer, dead slot (row 0) included.
        num_kv_heads: KV heads ``Hkv`` (after tensor parallel sharding, if any).
        head_dim: channels per head ``D``.
        dtype: element dtype of K and V (any torch floating dtype).
        device: where the buffers live.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim) < 1 or num_slots < 2:
            raise ValueError("num_layers, num_kv_heads, head_dim >= 1 and num_slots >= 2 required")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_buffer = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]
        self.v_buffer = [
            torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one slot occupies over all layers, K and V: ``2 * L * Hkv * D * itemsize``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of all buffers (``num_slots * bytes_per_token``)."""
        return self.num_slots * self.bytes_per_token

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        """Key buffer of ``layer``: ``[num_slots, Hkv, D]`` (the live tensor, not a copy)."""
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        """Value buffer of ``layer``: ``[num_slots, Hkv, D]`` (the live tensor, not a copy)."""
        return self.v_buffer[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of ``n`` tokens (SGLang's ``set_kv_buffer``).

        Args:
            layer: layer index.
            slots: int64 ``[n]`` target slots (never DEAD).
            k, v: ``[n, Hkv, D]``, cast to the pool dtype and device.
        """
        shape = (int(slots.numel()), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise ValueError(
                f"k and v must be {list(shape)}, got {list(k.shape)} / {list(v.shape)}"
            )
        if slots.device.type == "cpu" and bool((slots == DEAD).any()):
            raise ValueError("refusing to write K/V into the dead slot")
        idx = slots.to(self.device, torch.int64)
        self.k_buffer[layer][idx] = k.to(self.device, self.dtype)
        self.v_buffer[layer][idx] = v.to(self.device, self.dtype)

    set_kv_buffer = write

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy out K and V of ``slots`` (int64 ``[n]``): two ``[n, Hkv, D]`` tensors."""
        idx = slots.to(self.device, torch.int64)
        return self.k_buffer[layer][idx], self.v_buffer[layer][idx]
