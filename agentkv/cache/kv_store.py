"""The KV store facade the engines use.

It wires the allocator, the pool, per-request slot maps and the prefix cache together, and is
the only place that moves references between them:

- ``begin_request``: match the prefix cache (session namespace, else shared); the request's map
  starts as the matched slots, holes included, and takes its own reference on each.
- ``extend``: allocate slots for positions to be computed (LRU-evicting the prefix cache when
  short); the map holds the allocation's reference.
- ``evict`` / ``evict_per_head``: redirect to DEAD / clear mask bits; drop the map's reference of
  each position that became DEAD. A slot still held by the prefix cache or a sibling request
  stays resident, so evicting inside a cached prefix frees nothing and breaks nothing.
- ``finish_request``: insert the request into the prefix cache (the leading intact run into the
  shared namespace; the whole sequence, holes and masks included, into the session namespace
  when it has holes), then drop the map's references.

Lifecycle on SGLang terms: ``begin_request`` = ``match_prefix`` + ``inc_lock_ref``;
``extend`` = ``alloc`` into ``req_to_token``; ``cache_unfinished_request`` /
``finish_request`` = ``cache_unfinished_req`` / ``cache_finished_req``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentkv.cache.attention_metadata import build_layer_kv_index
from agentkv.cache.dead_slot import DEAD
from agentkv.cache.kv_pool import KVPool
from agentkv.cache.prefix_cache import PrefixCache, TreeNode
from agentkv.cache.slot_allocator import OutOfSlots, SlotAllocator, SlotRefcountError
from agentkv.cache.slot_map import SlotMap


@dataclass(eq=False)
class RequestKV:
    """KV state of one in-flight request.

    Attributes:
        request_id: store-local id.
        session_id: session namespace for holes, or ``None`` (then holes are never reused).
        token_ids: every token known so far (prompt, then decoded tokens as they are extended);
            ``token_ids[:len(slot_map)]`` have a slot.
        slot_map: logical position -> slot (+ keep mask).
        num_cached: positions already in the pool when the request began (prefix-cache hit,
            holes included): prefill starts at this position.
        prefix_hit_tokens: same count, kept for telemetry.
        prefix_from_session: whether the hit came from the session namespace.
        finished: set by ``finish_request``.
        namespace: tenant namespace (cache salt) the request matches and is cached under;
            ``None``: the default one.
    """

    request_id: int
    session_id: str | None
    token_ids: list[int]
    slot_map: SlotMap
    num_cached: int
    prefix_hit_tokens: int
    prefix_from_session: bool
    finished: bool = False
    namespace: str | None = None
    _locked: list[TreeNode] = field(default_factory=list, repr=False)

    @property
    def seq_len(self) -> int:
        """Positions with a slot (``len(slot_map)``)."""
        return len(self.slot_map)

    @property
    def num_pending(self) -> int:
        """Known tokens without a slot yet (the next ``extend`` allocates them)."""
        return len(self.token_ids) - len(self.slot_map)


@dataclass(frozen=True)
class EvictResult:
    """Outcome of one eviction call.

    Attributes:
        entries_evicted: (layer, KV head, position) entries that went from live to evicted.
        positions_dead: positions newly redirected to DEAD (each dropped one slot reference).
        slots_freed: slots that went back to the free list (reference count reached 0).
    """

    entries_evicted: int
    positions_dead: int
    slots_freed: int


@dataclass(frozen=True)
class RequestKVStats:
    """Per-request telemetry (token units unless said otherwise).

    Attributes:
        seq_len: positions with a slot map entry.
        num_cached: prefix-cache hit length (holes included).
        resident_slots: positions holding a real slot: memory this request keeps alive (slots
            shared with other holders included).
        dead_positions: positions redirected to DEAD.
        live_kv_entries: live (layer, KV head, position) entries.
        effective_live_tokens: ``live_kv_entries / (L * Hkv)`` (mask-weighted live KV).
        resident_bytes: ``resident_slots * bytes_per_token``.
    """

    seq_len: int
    num_cached: int
    resident_slots: int
    dead_positions: int
    live_kv_entries: int
    effective_live_tokens: float
    resident_bytes: int


@dataclass(frozen=True)
class KVStoreStats:
    """Store-wide telemetry.

    Attributes:
        capacity: slots that can be handed out (pool rows minus the dead slot).
        free_slots: slots on the free list.
        used_slots: slots held by requests and / or the prefix cache (memory actually held).
        bytes_per_token: bytes of one slot over all layers, K and V.
        used_bytes: ``used_slots * bytes_per_token``.
        pool_bytes: bytes of the whole pool (dead slot included).
        num_requests: in-flight requests.
        num_sessions: sessions with a prefix-cache namespace.
        prefix_cache_nodes: radix-tree nodes over all namespaces.
        prefix_cache_tokens: positions stored in the prefix cache (holes included; a slot in
            two namespaces counts twice).
        requests_resident_slots: sum of in-flight requests' resident slots (shared slots
            counted once per request).
        requests_effective_live_tokens: sum of in-flight requests' mask-weighted live KV.
    """

    capacity: int
    free_slots: int
    used_slots: int
    bytes_per_token: int
    used_bytes: int
    pool_bytes: int
    num_requests: int
    num_sessions: int
    prefix_cache_nodes: int
    prefix_cache_tokens: int
    requests_resident_slots: int
    requests_effective_live_tokens: float


class KVStore:
    """Token-slot KV store with dead-slot eviction and a hole-preserving prefix cache.

    Args:
        num_layers: ``L``.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        num_slots: pool rows, the dead slot (row 0) included; ``num_slots - 1`` are usable.
        dtype: K/V element dtype.
        device: pool device; bookkeeping (maps, counts, tree) stays on the CPU.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.allocator = SlotAllocator(num_slots)
        self.pool = KVPool(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)
        self.prefix_cache = PrefixCache(self.allocator, num_layers, num_kv_heads)
        self._ids = itertools.count()
        self._requests: dict[int, RequestKV] = {}

    # ------------------------------------------------------------ lifecycle
    def begin_request(
        self,
        session_id: str | None,
        token_ids: Sequence[int] | torch.Tensor,
        namespace: str | None = None,
    ) -> RequestKV:
        """Start a request for prompt ``token_ids`` (``T >= 1`` ids).

        Matches at most ``T - 1`` tokens (the last prompt token is always computed, so the
        forward pass yields logits), takes the request's own reference on every matched
        non-DEAD slot and locks the matched path against LRU eviction. ``namespace`` (a
        tenant's cache salt) scopes the match and, later, the caching of this request.
        """
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).tolist()
        if not tokens:
            raise ValueError("a request needs at least one token")
        match = self.prefix_cache.match(
            session_id, torch.tensor(tokens), max_len=len(tokens) - 1, namespace=namespace
        )
        slot_map = SlotMap(self.num_layers, self.num_kv_heads, match.slots, match.keep_mask)
        self.allocator.incref(slot_map.held_slots())
        self.prefix_cache.lock(match.last_node)
        req = RequestKV(
            request_id=next(self._ids),
            session_id=session_id,
            token_ids=tokens,
            slot_map=slot_map,
            num_cached=match.length,
            prefix_hit_tokens=match.length,
            prefix_from_session=match.from_session,
            namespace=namespace,
            _locked=[match.last_node],
        )
        self._requests[req.request_id] = req
        return req

    def extend(
        self, req: RequestKV, new_token_ids: Sequence[int] | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append ``new_token_ids`` (if any) and allocate slots for every position without one.

        Returns int64 ``[n]`` slots of positions ``seq_len_before .. seq_len_before + n - 1``,
        to be written with :meth:`write_kv`. When fewer than ``n`` slots are free, evicts
        least-recently-used prefix-cache nodes first; raises :class:`OutOfSlots` (the request
        unchanged) if that is still not enough.
        """
        self._check_live(req)
        new = (
            []
            if new_token_ids is None
            else torch.as_tensor(new_token_ids, dtype=torch.int64).reshape(-1).tolist()
        )
        n = req.num_pending + len(new)
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        self._reserve(n)
        slots = self.allocator.alloc(n)
        req.token_ids.extend(new)
        req.slot_map.append(slots)
        return slots

    def cache_unfinished_request(self, req: RequestKV, num_tokens: int | None = None) -> int:
        """Publish the request's first ``num_tokens`` positions (default all) to the shared
        namespace now, before its own evictions (SGLang ``cache_unfinished_req``): call it after
        prefill to share, say, the system prompt with other sessions even if this request then
        evicts parts of it. Only the leading intact run can be shared; returns the count
        published. The published path stays locked until the request finishes."""
        self._check_live(req)
        n = req.slot_map.intact_prefix_len()
        if num_tokens is not None:
            n = min(n, num_tokens)
        if n == 0:
            return 0
        node = self.prefix_cache.insert(
            torch.tensor(req.token_ids[:n]), req.slot_map.slots[:n].clone(), namespace=req.namespace
        )
        self.prefix_cache.lock(node)
        req._locked.append(node)
        return n

    def finish_request(self, req: RequestKV, cache: bool = True) -> None:
        """End ``req``. With ``cache=True``, store it in the prefix cache first: the leading
        intact run in the shared namespace; the whole sequence with its holes and keep mask in
        the session namespace when it has holes (and a session id). Then drop the request's
        references and locks. Raises ``RuntimeError`` when called twice."""
        self._check_live(req)
        sm = req.slot_map
        t = len(sm)
        if cache and t > 0:
            tokens = torch.tensor(req.token_ids[:t])
            intact = sm.intact_prefix_len()
            if intact > 0:
                self.prefix_cache.insert(
                    tokens[:intact], sm.slots[:intact].clone(), namespace=req.namespace
                )
            if intact < t and req.session_id is not None:
                mask = sm.keep_mask
                self.prefix_cache.insert(
                    tokens,
                    sm.slots.clone(),
                    None if mask is None else mask.clone(),
                    session_id=req.session_id,
                    namespace=req.namespace,
                )
        self.allocator.decref(sm.held_slots())
        for node in req._locked:
            self.prefix_cache.unlock(node)
        req._locked.clear()
        req.finished = True
        del self._requests[req.request_id]

    def end_session(self, session_id: str, namespace: str | None = None) -> int:
        """Drop the session's prefix-cache namespace; returns slots freed. In-flight requests
        of the session keep their KV (their own references)."""
        return self.prefix_cache.end_session(session_id, namespace)

    def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache namespace; returns slots freed."""
        return self.prefix_cache.flush()

    def evict_prefix_cache(self, num_slots: int) -> int:
        """LRU-evict unlocked prefix-cache leaves until ``num_slots`` slots are freed or none is
        left; returns slots freed."""
        return self.prefix_cache.evict(num_slots)

    # ------------------------------------------------------------------ KV
    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V (``[n, Hkv, D]``) of ``layer`` into ``slots`` (int64 ``[n]``)."""
        self.pool.write(layer, slots, k, v)

    def read_kv(
        self, req: RequestKV, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K/V that ``layer`` of ``req`` attends to, DEAD and fully evicted positions dropped.

        Returns ``(k, v, positions, head_mask)`` on the pool device: ``k``, ``v``
        ``[n, Hkv, D]``; ``positions`` int64 ``[n]`` logical positions (ascending);
        ``head_mask`` bool ``[Hkv, n]`` (``True`` = KV head may attend to that key) or ``None``
        when all heads see all ``n`` keys.
        """
        idx = build_layer_kv_index(req.slot_map, layer, device=self.pool.device)
        k, v = self.pool.gather(layer, idx.slots)
        return k, v, idx.positions, idx.head_mask

    # ------------------------------------------------------------ eviction
    def evict(self, req: RequestKV, positions: Sequence[int] | torch.Tensor) -> EvictResult:
        """Evict logical ``positions`` (int64 ``[k]``) of ``req`` in every layer and head."""
        self._check_live(req)
        before = req.slot_map.live_entries()
        released = req.slot_map.evict(positions)
        return self._release(req, before, released)

    def evict_per_head(self, req: RequestKV, keep_mask: torch.Tensor) -> EvictResult:
        """Evict per (layer, KV head): ``keep_mask`` bool ``[L, Hkv, T']`` (``T' <= seq_len``),
        ``False`` = evict. Positions left with no live head become DEAD."""
        self._check_live(req)
        before = req.slot_map.live_entries()
        released = req.slot_map.evict_heads(keep_mask)
        return self._release(req, before, released)

    # ----------------------------------------------------------- telemetry
    def request_stats(self, req: RequestKV) -> RequestKVStats:
        """Telemetry of one request."""
        sm = req.slot_map
        resident = sm.num_resident
        return RequestKVStats(
            seq_len=len(sm),
            num_cached=req.num_cached,
            resident_slots=resident,
            dead_positions=len(sm) - resident,
            live_kv_entries=sm.live_entries(),
            effective_live_tokens=sm.effective_live_tokens(),
            resident_bytes=resident * self.pool.bytes_per_token,
        )

    def stats(self) -> KVStoreStats:
        """Store-wide telemetry."""
        a, bpt = self.allocator, self.pool.bytes_per_token
        reqs = list(self._requests.values())
        return KVStoreStats(
            capacity=a.capacity,
            free_slots=a.free_count,
            used_slots=a.used_count,
            bytes_per_token=bpt,
            used_bytes=a.used_count * bpt,
            pool_bytes=self.pool.total_bytes,
            num_requests=len(reqs),
            num_sessions=len(self.prefix_cache.sessions()),
            prefix_cache_nodes=self.prefix_cache.num_nodes,
            prefix_cache_tokens=self.prefix_cache.cached_tokens,
            requests_resident_slots=sum(r.slot_map.num_resident for r in reqs),
            requests_effective_live_tokens=sum(r.slot_map.effective_live_tokens() for r in reqs),
        )

    def requests(self) -> list[RequestKV]:
        """In-flight requests."""
        return list(self._requests.values())

    def check_invariants(self) -> None:
        """Recount every reference and lock from scratch and compare with the live state.

        For tests and debug runs (cost ``O(num_slots + cached tokens)``). Checks: each slot's
        count equals the number of request maps and prefix-cache nodes holding it; the free
        list is exactly the unreferenced slots, without repeats or DEAD; DEAD is unreferenced;
        the shared namespace holds no hole; each map's DEAD entries are exactly its positions
        with no live head; a slot sits at one logical position wherever it is held; lock
        counts match the in-flight requests. Raises :class:`SlotRefcountError` on a violation.
        """
        n = self.allocator.num_slots
        expected = torch.zeros(n, dtype=torch.int32)
        where = torch.full((n,), -1, dtype=torch.int64)

        def hold(slots: torch.Tensor, start: int, what: str) -> None:
            pos = torch.arange(start, start + int(slots.numel()))
            live = slots != DEAD
            s, p = slots[live], pos[live]
            expected.index_add_(0, s, torch.ones_like(s, dtype=torch.int32))
            seen = where[s]
            clash = (seen >= 0) & (seen != p)
            if bool(clash.any()):
                raise SlotRefcountError(f"{what}: slot(s) {s[clash].tolist()[:8]} moved position")
            where[s] = p

        for req in self._requests.values():
            sm = req.slot_map
            hold(sm.slots, 0, f"request {req.request_id}")
            mask = sm.keep_mask
            if mask is not None and bool((mask.any(dim=1).any(dim=0) != sm.resident()).any()):
                raise SlotRefcountError(f"request {req.request_id}: DEAD entries != fully evicted")
        roots = {id(r) for r in self.prefix_cache.roots()}
        for sid, start, node in self.prefix_cache.iter_nodes():
            hold(node.value, start, f"prefix-cache node of {sid!r}")
            if sid is None and (node.keep_mask is not None or bool((node.value == DEAD).any())):
                raise SlotRefcountError("the shared namespace holds a hole")
        rc = self.allocator.refcount()
        if int(rc[DEAD]) != 0 or bool((rc != expected).any()):
            bad = torch.nonzero(rc != expected).reshape(-1)[:8].tolist()
            raise SlotRefcountError(
                f"refcount mismatch at slots {bad}: counted {expected[bad].tolist()}, "
                f"allocator has {rc[bad].tolist()}"
            )
        free = self.allocator.free_slots()
        unreferenced = torch.nonzero(rc == 0).reshape(-1)
        unreferenced = unreferenced[unreferenced != DEAD]
        if free.numel() != unreferenced.numel() or not torch.equal(
            free.sort().values, unreferenced
        ):
            raise SlotRefcountError("the free list is not exactly the unreferenced slots")
        locks: dict[int, int] = {}
        for req in self._requests.values():
            for node in req._locked:
                chain, top = [], node
                while top.parent is not None:
                    chain.append(top)
                    top = top.parent
                if id(top) in roots:  # locks inside dropped namespaces do not count
                    for c in chain:
                        locks[id(c)] = locks.get(id(c), 0) + 1
        for _, _, node in self.prefix_cache.iter_nodes():
            if node.lock_ref != locks.get(id(node), 0):
                raise SlotRefcountError("prefix-cache lock count differs from in-flight requests")

    # ------------------------------------------------------------- private
    def _check_live(self, req: RequestKV) -> None:
        if req.finished or self._requests.get(req.request_id) is not req:
            raise RuntimeError(f"request {req.request_id} is finished or not from this store")

    def _reserve(self, n: int) -> None:
        short = n - self.allocator.free_count
        if short > 0:
            self.prefix_cache.evict(short)
        if n > self.allocator.free_count:
            raise OutOfSlots(
                f"need {n} KV slots, {self.allocator.free_count} free of "
                f"{self.allocator.capacity} after evicting every unlocked prefix-cache node; "
                f"{len(self._requests)} requests in flight hold the rest"
            )

    def _release(self, req: RequestKV, before: int, released: torch.Tensor) -> EvictResult:
        freed = self.allocator.decref(released)
        return EvictResult(
            entries_evicted=before - req.slot_map.live_entries(),
            positions_dead=int(released.numel()),
            slots_freed=int(freed.numel()),
        )
