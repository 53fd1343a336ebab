"""KV store: token-slot pools, per-request slot maps, the dead slot, a reference-counted slot
allocator and a hole-preserving prefix cache (modelled on SGLang's ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, ``MHATokenToKVPool`` and ``RadixCache``). See ``docs/cache.md``.
"""

from agentkv.cache.attention_metadata import (
    BatchKVIndices,
    LayerKVIndex,
    build_batch_kv_indices,
    build_layer_kv_index,
)
from agentkv.cache.dead_slot import DEAD, live_slots
from agentkv.cache.kv_pool import KVPool
from agentkv.cache.kv_store import EvictResult, KVStore, KVStoreStats, RequestKV, RequestKVStats
from agentkv.cache.prefix_cache import MatchResult, PrefixCache, TreeNode
from agentkv.cache.slot_allocator import OutOfSlots, SlotAllocator, SlotRefcountError
from agentkv.cache.slot_map import SlotMap

__all__ = [
    "DEAD",
    "BatchKVIndices",
    "EvictResult",
    "KVPool",
    "KVStore",
    "KVStoreStats",
    "LayerKVIndex",
    "MatchResult",
    "OutOfSlots",
    "PrefixCache",
    "RequestKV",
    "RequestKVStats",
    "SlotAllocator",
    "SlotMap",
    "SlotRefcountError",
    "TreeNode",
    "build_batch_kv_indices",
    "build_layer_kv_index",
    "live_slots",
]
