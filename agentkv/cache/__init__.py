"""KV store: mixed-precision pools (the kernels' full / INT4 / INT2 layout), per-request slot
maps at (layer, KV head) grain, the dead slot, a reference-counted cell allocator and a
hole-preserving prefix cache (modelled on SGLang's ``ReqToTokenPool``,
``TokenToKVPoolAllocator``, ``MHATokenToKVPool`` and ``RadixCache``). See ``docs/cache.md``.
"""

from agentkv.cache.dead_slot import DEAD, live_slots
from agentkv.cache.decode_index import DecodeIndex
from agentkv.cache.kv_pool import KVPool
from agentkv.cache.kv_store import (
    CompactionResult,
    EvictResult,
    KVStore,
    KVStoreStats,
    PrecisionResult,
    RequestKV,
    RequestKVStats,
)
from agentkv.cache.precision import Precision
from agentkv.cache.prefix_cache import MatchResult, PrefixCache, TreeNode
from agentkv.cache.slot_allocator import OutOfSlots, PoolLayout, SlotAllocator, SlotRefcountError
from agentkv.cache.slot_map import SlotMap

__all__ = [
    "DEAD",
    "CompactionResult",
    "DecodeIndex",
    "EvictResult",
    "KVPool",
    "KVStore",
    "KVStoreStats",
    "MatchResult",
    "OutOfSlots",
    "PoolLayout",
    "Precision",
    "PrecisionResult",
    "PrefixCache",
    "RequestKV",
    "RequestKVStats",
    "SlotAllocator",
    "SlotMap",
    "SlotRefcountError",
    "TreeNode",
    "live_slots",
]
