"""``AgentKVRadixCache``: SGLang's ``RadixCache`` that keeps holes per session and frees by
reference count (registered as ``--radix-cache-backend agentkv``).

Namespaces (SGLang's ``RadixKey.extra_key``, which keeps subtrees disjoint):

- **shared**: the request's own ``extra_key`` (SGLang's tenant namespace: ``cache_salt`` +
  ``extra_key``). Only intact content goes there: the leading run of a sequence before its
  first DEAD position. Any request of the tenant reuses it (the system prompt), as in stock
  SGLang.
- **session**: ``<extra_key>\\x1fagentkv-session\\x1f<session id>#<generation>``. A finished
  request with holes inserts its whole sequence (DEAD included) under a new generation of its
  session and the previous generation is dropped, so the tree holds each session's latest
  sequence exactly as the session left it. The next turn matches it, holes included: no
  recompute of what was evicted and no resurrection of it.

The two namespaces alias the same slots (a session's copy of the system prompt is the shared
copy's slots); :class:`~integrations.sglang.slot_refcounts.RefCountedTokenAllocator` counts one
reference per tree node and per request, so a slot is freed only when its last holder goes.
DEAD is never counted, never freed.

Prefix reuse follows the embedded engine: a request with a session matches the longer of its
session's sequence and the shared namespace (the session's wins ties); methods that observe
prefill (IntentKV, SnapKV, H2O) never reuse the actionable query (its queries must be seen),
and ``Method.prefix_reuse`` can shorten the match further.
"""

from __future__ import annotations

import heapq
import logging
import time
from typing import Any

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from agentkv.integrations.sglang.host_time import timed
from agentkv.integrations.sglang.request_plan import (
    HOLEY,
    SESSION_MARK,
    AgentKVRequest,
    request_state,
)
from agentkv.integrations.sglang.slot_refcounts import RefCountedTokenAllocator

logger = logging.getLogger(__name__)


def _stop_watching(pool_idx: Any, state: AgentKVRequest) -> None:
    """Drop the request from the observer tables (a retracted request gets them back when it
    is computed again; its row index may go to another request meanwhile)."""
    from agentkv.integrations.sglang.hidden_states import HIDDEN_DECODING, HIDDEN_OBSERVING
    from agentkv.integrations.sglang.runtime import OBSERVING

    for watching in (OBSERVING, HIDDEN_OBSERVING):
        if watching.get(pool_idx) is state:
            del watching[pool_idx]
    watch = HIDDEN_DECODING.get(pool_idx)
    if watch is not None and watch.state is state:
        del HIDDEN_DECODING[pool_idx]


def _is_session_key(extra_key: Any) -> bool:
    """Whether a radix key's ``extra_key`` is a session namespace (:data:`SESSION_MARK`)."""
    return isinstance(extra_key, str) and SESSION_MARK in extra_key


def _may_hold_dead(req: Any, state: AgentKVRequest | None) -> bool:
    """Whether the request's row can hold DEAD: only when it has agentkv state and either a
    plan made holes (``state.holey``) or its prefix was not matched in the shared namespace
    (which holds intact runs only). Without a payload a request matches only there."""
    if state is None:
        return False
    prefix = getattr(req, "prefix_indices", None)
    if prefix is None:
        return True
    return state.holey or (len(prefix) > 0 and prefix is not state.intact_prefix)


class AgentKVRadixCache(RadixCache):
    """Radix cache with per-session hole-preserving namespaces and reference-counted frees.

    Page size 1 only (SGLang's ``TokenToKVPoolAllocator``). ``methods`` (an
    ``agentkv.methods.MethodSet``) lets prefix matching ask the request's method how much to
    reuse; None: reuse everything that matches.
    """

    def __init__(self, params: CacheInitParams, methods: Any = None):
        if params.page_size != 1:
            raise ValueError("the agentkv radix cache needs --page-size 1")
        if params.token_to_kv_pool_allocator is not None:
            RefCountedTokenAllocator.adopt(params.token_to_kv_pool_allocator)
        self.methods = methods
        #: session key -> current generation number (its sequence lives at f"{key}#{gen}")
        self.session_generation: dict[str, int] = {}
        #: tokens in session namespaces: the only nodes that alias slots or hold DEAD
        self.session_tokens = 0
        super().__init__(params)

    @property
    def allocator(self) -> RefCountedTokenAllocator:
        return self.token_to_kv_pool_allocator

    # ---- namespaces ----------------------------------------------------------------------

    def session_namespace(self, state: AgentKVRequest) -> str | None:
        """The extra_key of the session's current sequence, or None when it has none."""
        gen = self.session_generation.get(state.session_key)
        return None if gen is None else f"{state.session_key}#{gen}"

    def reset(self) -> None:
        super().reset()
        self.session_generation = {}
        self.session_tokens = 0

    # ---- matching ----------------------------------------------------------------------------

    @timed("radix_match")
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        state = request_state(req) if req is not None else None
        if state is None:
            return super().match_prefix(params)
        key = params.key
        limit = self._reuse_limit(state, len(key))
        if key.limit is None or limit < key.limit:
            key = RadixKey(key.token_ids, key.extra_key, key.is_bigram, limit)
        best = super().match_prefix(MatchPrefixParams(key=key, req=req))
        ns = self.session_namespace(state)
        from_session = False
        if ns is not None:
            mine = super().match_prefix(
                MatchPrefixParams(key=RadixKey(key.token_ids, ns, key.is_bigram, key.limit))
            )
            if len(mine.device_indices) >= len(best.device_indices):
                best, from_session = mine, True  # a session's sequence: it may hold DEAD
        # the shared namespace holds intact runs only: this prefix needs no DEAD count
        state.intact_prefix = None if from_session else best.device_indices
        return best

    def _reuse_limit(self, state: AgentKVRequest, n: int) -> int:
        """Tokens offered to the match (it reuses at most this many)."""
        if self.methods is None:
            return n
        policy = state.payload.policy
        try:
            method = self.methods.for_policy(policy)
        except ValueError:  # refused by Method.check: the plan step logs it, no reuse cap
            return n
        limit = n
        if method.observes_prefill:
            act = state.tags.actionable
            first = next((i for i, a in enumerate(act) if a), None)
            limit = first if first is not None else n - method.observed_tail(policy)
        limit = method.prefix_reuse(policy, state.payload.session_id, max(1, limit))
        return max(0, min(n, limit))

    # ---- inserting ---------------------------------------------------------------------------

    def insert(self, params: InsertParams) -> InsertResult:
        """SGLang's insert; the new node (what did not match) takes a reference on its slots."""
        result = super().insert(params)
        if params.value is not None and not self.disable:
            n = len(params.key)
            # a new node is created unlocked: nothing to pin
            self.allocator.tree_incref(params.value[result.prefix_len : n])
            if _is_session_key(params.key.extra_key):
                self.session_tokens += n - result.prefix_len
        return result

    def _delete_leaf(self, node: TreeNode) -> None:
        super()._delete_leaf(node)
        if _is_session_key(node.key.extra_key):
            self.session_tokens -= len(node.key)

    def _insert_sequence(self, state: AgentKVRequest | None, req: Any, token_ids, row, new_gen):
        """Insert one request's sequence: the intact leading run into the shared namespace;
        with holes and a session, the whole sequence into the session's namespace (the current
        generation, or a new one when ``new_gen``). Returns the extra_key that covers the whole
        sequence (None: nothing covers it), the previous generation's key to drop, and for an
        intact row where the request's own duplicates end (SGLang's ``prefix_len`` of the
        insert: the tree holds the row from there on), None for a holey row."""
        dead = self.allocator.dead_slot
        if not _may_hold_dead(req, state):  # no host read for an intact row
            if self.allocator.strict and bool((row == dead).any()):
                raise RuntimeError("agentkv radix cache: DEAD in the row of an intact request")
            holes = row.new_empty(0)
            intact = len(token_ids)
        else:
            holes = torch.nonzero(row == dead).reshape(-1)
            intact = int(holes[0]) if holes.numel() else len(token_ids)
        prio = getattr(req, "priority", 0) or 0
        owned_end = len(token_ids)
        if intact:
            owned_end = self.insert(
                InsertParams(
                    key=RadixKey(token_ids[:intact], req.extra_key),
                    value=row[:intact].to(torch.int64),
                    priority=prio,
                )
            ).prefix_len
        if not holes.numel():
            return req.extra_key, None, owned_end
        if state is None:
            return None, None, None
        old = self.session_namespace(state)
        if new_gen or old is None:
            self.session_generation[state.session_key] = (
                self.session_generation.get(state.session_key, -1) + 1
            )
        ns = self.session_namespace(state)
        self.insert(
            InsertParams(key=RadixKey(token_ids, ns), value=row.to(torch.int64), priority=prio)
        )
        return ns, (old if old != ns else None), None

    def _let_go(self, req: Any, row: torch.Tensor, owned_end: int | None) -> None:
        """The request lets go of every slot it allocated (``row[cache_protected_len:]``; the
        tree holds its own references). An intact row does it as stock SGLang does, with no
        host read: the request's duplicates (before ``owned_end``) are freed now, the rest is
        the tree's now and stays. A holey row's slots (aliases, DEAD) are counted down and
        settled later."""
        start = req.cache_protected_len
        if owned_end is None:
            self.allocator.free(row[start:])
            return
        cut = max(start, owned_end)
        self.allocator.release_owned(row[start:cut])
        self.allocator.drop_refs(row[cut:])

    @timed("radix_finish")
    def cache_finished_req(self, req: Any, is_insert: bool = True, *, kv_len_to_handle: int):
        if self.disable_finished_insert:
            is_insert = False
        if self.disable:
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        state = request_state(req)
        token_ids = (req.origin_input_ids + req.output_ids)[:kv_len_to_handle]
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        drop = None
        if is_insert:
            _, drop, owned_end = self._insert_sequence(state, req, token_ids, row, new_gen=True)
        else:  # aborted / retracted: nothing inserted, every slot it allocated is its own
            owned_end = len(token_ids) if not _may_hold_dead(req, state) else None
        self._let_go(req, row, owned_end)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        if drop is not None:
            self.drop_namespace(drop)
        if state is not None:
            HOLEY.release(state)
            _stop_watching(req.req_pool_idx, state)  # finished, aborted or retracted
            if not is_insert:  # retracted: computed (and planned) again later, from the start
                state.planned = False
                state.observer = None  # what it saw of the rows computed so far would count twice

    @timed("radix_unfinished")
    def cache_unfinished_req(self, req: Any, chunked: bool = False):
        if self.disable:
            return
        state = request_state(req)
        token_ids = req.get_fill_ids()
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        ns, _, owned_end = self._insert_sequence(state, req, token_ids, row, new_gen=False)
        self._let_go(req, row, owned_end)
        if ns is None:  # holes but no session: nothing in the tree covers the row
            ns = req.extra_key
        match = super().match_prefix(MatchPrefixParams(key=RadixKey(token_ids, ns)))
        new_indices, new_last_node = match.device_indices, match.last_device_node
        if state is not None:  # the next chunk's prefix; intact when the shared copy covers it
            state.intact_prefix = new_indices if ns == req.extra_key else None
        if len(new_indices) != len(token_ids):
            raise RuntimeError(
                f"agentkv radix cache: re-match found {len(new_indices)} of {len(token_ids)} tokens"
            )
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(req.cache_protected_len, len(new_indices))),
            new_indices[req.cache_protected_len :],
        )
        req.cache_protected_len = len(new_indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        req.prefix_indices = new_indices
        req.last_node = new_last_node

    # ---- freeing -----------------------------------------------------------------------------

    @timed("radix_evict")
    def evict(self, params: EvictParams) -> EvictResult:
        """LRU eviction counted in slots actually freed (an aliased or DEAD entry frees
        nothing), so SGLang gets the room it asked for whenever the tree can give it.

        No host read per node. While no session namespace exists no slot is aliased: a
        leaf's slots are its alone and are freed at once, counted as stock SGLang counts them
        (``len(value)``). Otherwise in rounds: leaves are taken until their entries (an upper
        bound of what they free) cover what is still missing, then the allocator settles once
        and says what was freed; another round only when aliases or DEAD freed less."""
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        heap = [(self.eviction_strategy.get_priority(n), n) for n in self.evictable_leaves]
        heapq.heapify(heap)
        aliased = self.session_tokens > 0
        base = self.allocator.available_size() if aliased else 0  # (settles earlier frees)
        freed = 0
        while freed < params.num_tokens and heap:
            bound = freed
            while bound < params.num_tokens and heap:
                _, x = heapq.heappop(heap)
                bound += len(x.value)
                if aliased:
                    self.allocator.tree_decref(x.value)
                else:
                    self.allocator.release_owned(x.value, tree=True)
                self._delete_leaf(x)
                if len(x.parent.children) == 0 and x.parent.lock_ref == 0:
                    heapq.heappush(heap, (self.eviction_strategy.get_priority(x.parent), x.parent))
                self._record_remove_event(x)
            # aliased: one host read per round
            freed = self.allocator.available_size() - base if aliased else bound
        self.update_eviction_metrics(freed, start)
        return EvictResult(num_tokens_evicted=freed)

    def drop_namespace(self, extra_key: str) -> int:
        """Delete every node of one namespace (a superseded session generation) unless one of
        them is locked (a request of the session still runs on it: LRU takes it later).
        Returns the nodes deleted (their slots are freed at the allocator's next settle)."""
        tops = [
            c
            for k, c in self.root_node.children.items()
            if isinstance(k, tuple) and k[0] == extra_key
        ]
        nodes: list[TreeNode] = []
        stack = list(tops)
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        if any(n.lock_ref > 0 for n in nodes):
            return 0
        for n in reversed(nodes):  # children before parents
            self.allocator.tree_decref(n.value)
            self._delete_leaf(n)
            self._record_remove_event(n)
        return len(nodes)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        if self.disable:
            return IncLockRefResult(delta=0)
        newly = self._path_with_lock(node, 0)
        result = super().inc_lock_ref(node)
        if newly:
            self.allocator.pin(torch.cat(newly), +1)
        return result

    def dec_lock_ref(self, node: TreeNode, params: Any = None) -> DecLockRefResult:
        if self.disable:
            return DecLockRefResult(delta=0)
        last = self._path_with_lock(node, 1)
        result = super().dec_lock_ref(node, params)
        if last:
            self.allocator.pin(torch.cat(last), -1)
        return result

    def _path_with_lock(self, node: TreeNode, lock: int) -> list[torch.Tensor]:
        out = []
        while node is not None and node is not self.root_node:
            if node.lock_ref == lock:
                out.append(node.value)
            node = node.parent
        return out

    # ---- accounting --------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.physical_sizes()[0]

    def protected_size(self) -> int:
        return self.physical_sizes()[1]

    def physical_sizes(self) -> tuple[int, int]:
        """``(evictable, protected)`` slots (DEAD counted as protected). With no session
        namespace in the tree no slot is aliased and no node holds DEAD, so SGLang's own
        counters (kept by the tree on every insert, lock and delete) are exact: no host read,
        as in stock SGLang. Otherwise the allocator's recount
        (:meth:`~.slot_refcounts.RefCountedTokenAllocator.physical_sizes`)."""
        if self.session_tokens == 0:
            return self.evictable_size_, self.protected_size_ + 1
        return self.allocator.physical_sizes()

    def check_invariants(self) -> None:
        """Recount every reference and pin from the tree and the given request rows: raises
        ``SlotRefcountError`` (or AssertionError) on any mismatch. For tests."""
        self.allocator.check()
        cached = self.allocator.physical_sizes()
        self.allocator._sizes = None
        recount = self.allocator.physical_sizes()
        assert cached == recount, "stale cached evictable/protected sizes"
        assert self.physical_sizes() == recount, "the tree's counters differ from the recount"
        tree = torch.zeros_like(self.allocator.tree_refs)
        pins = torch.zeros_like(self.allocator.pins)
        stack = list(self.root_node.children.values())
        dead = self.allocator.dead_slot
        session = 0
        while stack:
            n = stack.pop()
            if _is_session_key(n.key.extra_key):
                session += len(n.key)
            v = n.value.to(torch.int64)
            v = v[v != dead]
            tree.index_add_(0, v, torch.ones_like(v, dtype=torch.int32))
            if n.lock_ref > 0:
                pins.index_add_(0, v, torch.ones_like(v, dtype=torch.int32))
            stack.extend(n.children.values())
        assert torch.equal(tree, self.allocator.tree_refs), "tree references differ from the tree"
        assert self.session_tokens == session, "session-namespace tokens miscounted"
        assert torch.equal(pins, self.allocator.pins), "pins differ from the locked nodes"
