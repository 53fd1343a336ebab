"""The KV store facade the engines use.

It wires the cell allocator, the mixed-precision pools, per-request slot maps and the prefix
cache together, and is the only place that moves references between them:

- ``begin_request``: match the prefix cache (session namespace, else shared); the request's
  map starts as the matched cells (holes and quantized cells included) and takes its own
  reference on each.
- ``extend``: allocate a full-precision cell in every (layer, KV head) column for each
  position to be computed (LRU-evicting the prefix cache when short).
- ``evict`` / ``evict_per_head``: redirect cells to DEAD and drop the map's reference on each;
  a cell still held by the prefix cache or a sibling request stays resident, so evicting
  inside a cached prefix frees nothing and breaks nothing.
- ``set_precision``: quantize live full-precision cells once, on the write path, into fresh
  INT4 cells or INT2 pages of the same column, then release the full cells (no hidden
  full-precision copy).
- ``finish_request``: insert the request into the prefix cache (the leading intact run into
  the shared namespace; the whole sequence, holes and quantized cells included, into the
  session namespace), then drop the map's references.

Memory is freed at (layer, KV head) grain: each column allocates its own cells, so a
per-head eviction or demotion returns that head's bytes. ``resident_bytes`` counts the cells
a request holds, by precision.

Lifecycle on SGLang terms: ``begin_request`` = ``match_prefix`` + ``inc_lock_ref``;
``extend`` = ``alloc`` into ``req_to_token``; ``cache_unfinished_request`` /
``finish_request`` = ``cache_unfinished_req`` / ``cache_finished_req``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentkv.cache.dead_slot import DEAD
from agentkv.cache.kv_pool import KVPool
from agentkv.cache.precision import Precision
from agentkv.cache.prefix_cache import PrefixCache, TreeNode
from agentkv.cache.slot_allocator import OutOfSlots, PoolLayout, SlotAllocator, SlotRefcountError
from agentkv.cache.slot_map import SlotMap
from agentkv.kernels import INT2_PAGE
from agentkv.kernels.backend import Backend

QUANTIZED = (Precision.INT4, Precision.INT2)


@dataclass(eq=False)
class RequestKV:
    """KV state of one in-flight request.

    Attributes:
        request_id: store-local id.
        session_id: session namespace for holes, or ``None`` (then holes are never reused).
        token_ids: every token known so far (prompt, then decoded tokens as they are extended);
            ``token_ids[:len(slot_map)]`` have cells.
        slot_map: (layer, KV head) column x position -> cell.
        num_cached: positions already in the pool when the request began (prefix-cache hit,
            holes included): prefill starts at this position.
        prefix_hit_tokens: same count, kept for telemetry.
        prefix_from_session: whether the hit came from the session namespace.
        finished: set by ``finish_request``.
        namespace: tenant namespace (cache salt) the request matches and is cached under;
            ``None``: the default one.
        int4_thinned: an eviction dropped INT4 cells of this request since the last
            :meth:`KVStore.compact_int4` (which only then looks for sparse runs).
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
    int4_thinned: bool = False
    _locked: list[TreeNode] = field(default_factory=list, repr=False)

    @property
    def seq_len(self) -> int:
        """Positions with cells (``len(slot_map)``)."""
        return len(self.slot_map)

    @property
    def num_pending(self) -> int:
        """Known tokens without cells yet (the next ``extend`` allocates them)."""
        return len(self.token_ids) - len(self.slot_map)


@dataclass(frozen=True)
class EvictResult:
    """Outcome of one eviction call.

    Attributes:
        entries_evicted: (layer, KV head, position) cells that went from live to evicted.
        positions_dead: positions newly left with no live cell in any column.
        slots_freed: cells that went back to the free lists (reference count reached 0).
        released: int64 ``[L * Hkv, n]`` the cells the request's map dropped (DEAD where
            none): what a decode index follows (:meth:`DecodeIndex.drop`).
    """

    entries_evicted: int
    positions_dead: int
    slots_freed: int
    released: torch.Tensor = field(compare=False, repr=False)


@dataclass(frozen=True)
class PrecisionResult:
    """Outcome of one :meth:`KVStore.set_precision` call: cells moved to each precision
    (``int4`` includes INT2-bound cells that did not fill a page) and full cells freed."""

    int4: int
    int2: int
    slots_freed: int


@dataclass(frozen=True)
class CompactionResult:
    """Outcome of one :meth:`KVStore.compact_int4` call: (layer, KV head) columns whose INT4
    cells moved, and cells moved (resident bytes unchanged: each moved cell's old one was
    freed)."""

    columns: int
    cells_moved: int


@dataclass(frozen=True)
class RequestKVStats:
    """Per-request telemetry (token units unless said otherwise).

    Attributes:
        seq_len: positions with a slot map entry.
        num_cached: prefix-cache hit length (holes included).
        resident_slots: positions with at least one live cell.
        dead_positions: positions with no live cell.
        live_kv_entries: live (layer, KV head, position) cells.
        effective_live_tokens: ``live_kv_entries / (L * Hkv)``.
        resident_bytes: bytes of every cell the request holds (shared ones included), scales
            included: what the pools hold for it.
        resident_bytes_by_precision: the same split by ``"full" | "int4" | "int2"``.
        cells_by_precision: live cells per precision.
        effective_bytes: ``effective_live_tokens * bytes_per_token`` (live KV as if full).
        slot_map_bytes: host bytes of the slot map itself (``8 * L * Hkv * seq_len``).
    """

    seq_len: int
    num_cached: int
    resident_slots: int
    dead_positions: int
    live_kv_entries: int
    effective_live_tokens: float
    resident_bytes: int
    resident_bytes_by_precision: dict[str, int]
    cells_by_precision: dict[str, int]
    effective_bytes: int
    slot_map_bytes: int


@dataclass(frozen=True)
class KVStoreStats:
    """Store-wide telemetry.

    Attributes:
        capacity: full-precision cells per column that can be handed out.
        free_slots: free full-precision cells in the fullest column (tokens that can still be
            extended).
        used_slots: full-precision cells in use, averaged over columns (token units).
        bytes_per_token: bytes of one token at full precision over all layers and heads.
        used_bytes: bytes of every cell in use (all precisions, all holders).
        used_bytes_by_precision: the same split by precision.
        pool_bytes: bytes of all pool buffers.
        num_requests: in-flight requests.
        num_sessions: sessions with a prefix-cache namespace.
        prefix_cache_nodes: radix-tree nodes over all namespaces.
        prefix_cache_tokens: positions stored in the prefix cache (holes included).
        requests_resident_slots: sum of in-flight requests' resident positions.
        requests_effective_live_tokens: sum of in-flight requests' live cells per column.
    """

    capacity: int
    free_slots: int
    used_slots: int
    bytes_per_token: int
    used_bytes: int
    used_bytes_by_precision: dict[str, int]
    pool_bytes: int
    num_requests: int
    num_sessions: int
    prefix_cache_nodes: int
    prefix_cache_tokens: int
    requests_resident_slots: int
    requests_effective_live_tokens: float


class KVStore:
    """Mixed-precision KV store with per-(layer, head) cells and a hole-preserving prefix cache.

    Args:
        num_layers: ``L``.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        num_slots: full-precision pool rows per layer, the dead slot (row 0) included;
            ``num_slots - 1`` tokens fit at full precision.
        dtype: full-precision K/V dtype.
        device: pool device; bookkeeping (maps, counts, tree) stays on the CPU.
        int4_slots: INT4 pool rows per layer (default ``num_slots``; 0 = no INT4 pool).
        int2_pages: INT2 pages (32 rows) per layer (default ``num_slots // 32``; 0 = none).
        backend: kernels backend for gathers (default: Triton on CUDA, torch on CPU).
        int4_min_density: :meth:`compact_int4`'s default: INT4 cells are moved out of the
            32-cell runs they fill less than this fraction of (0, the default: never). Off
            by default: the move's host bookkeeping (~0.2 µs per moved cell) outweighs the
            decode kernel's gain for thousands of steps (docs/cache.md, "Compaction").
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        int4_slots: int | None = None,
        int2_pages: int | None = None,
        backend: Backend | None = None,
        int4_min_density: float = 0.0,
    ) -> None:
        if not 0.0 <= int4_min_density <= 1.0:
            raise ValueError(f"int4_min_density must be in [0, 1], got {int4_min_density}")
        self.int4_min_density = float(int4_min_density)
        quantizable = head_dim % 32 == 0 and head_dim & (head_dim - 1) == 0
        if int4_slots is None:
            int4_slots = num_slots if quantizable else 0
        if int2_pages is None:
            int2_pages = num_slots // INT2_PAGE if quantizable else 0
        self.layout = PoolLayout(num_slots, int4_slots, int2_pages)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_columns = num_layers * num_kv_heads
        self.allocator = SlotAllocator(self.num_columns, self.layout)
        self.pool = KVPool(num_layers, num_kv_heads, head_dim, self.layout, dtype, device, backend)
        self.prefix_cache = PrefixCache(self.allocator)
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
        non-DEAD cell and locks the matched path against LRU eviction. ``namespace`` (a
        tenant's cache salt) scopes the match and, later, the caching of this request.
        """
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).tolist()
        if not tokens:
            raise ValueError("a request needs at least one token")
        match = self.prefix_cache.match(
            session_id, torch.tensor(tokens), max_len=len(tokens) - 1, namespace=namespace
        )
        slot_map = SlotMap(
            self.num_layers, self.num_kv_heads, match.slots, full_limit=self.layout.int4_base
        )
        self.allocator.incref(slot_map.slots)
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
        """Append ``new_token_ids`` (if any) and allocate full-precision cells for every
        position without one.

        Returns int64 ``[L * Hkv, n]`` cells of positions ``seq_len_before ..``, to be
        written with :meth:`write_kv`. When a column has fewer than ``n`` free cells, evicts
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
            return torch.empty(self.num_columns, 0, dtype=torch.int64)
        self._reserve(n)
        cells = self.allocator.alloc(n)
        req.token_ids.extend(new)
        req.slot_map.append(cells)
        return cells

    def truncate(self, req: RequestKV, n: int) -> EvictResult:
        """Drop ``req``'s last ``n`` positions, as if never extended: their cells go back
        (the counts of an eviction of them), their token ids go. Only positions this request
        computed (past its prefix-cache match) and with no pending token after them: a step
        the engine launched on a token it had not read yet, which ended the decode (or a
        step that could not launch)."""
        self._check_live(req)
        if req.num_pending:
            raise ValueError("truncate() with pending tokens (extend them first)")
        if not 0 <= n <= req.seq_len - req.num_cached:
            raise ValueError(
                f"can drop 0..{req.seq_len - req.num_cached} computed positions, got {n}"
            )
        released = req.slot_map.truncate(n)
        del req.token_ids[req.seq_len :]
        return self._release(req, *self._window_counts(released), released)

    def cache_unfinished_request(self, req: RequestKV, num_tokens: int | None = None) -> int:
        """Publish the request's first ``num_tokens`` positions (default all) to the shared
        namespace now, before its own evictions (SGLang ``cache_unfinished_req``). Only the
        leading intact run can be shared; returns the count published. The published path
        stays locked until the request finishes."""
        self._check_live(req)
        n = req.slot_map.intact_prefix_len()
        if num_tokens is not None:
            n = min(n, num_tokens)
        if n == 0:
            return 0
        node = self.prefix_cache.insert(
            torch.tensor(req.token_ids[:n]),
            req.slot_map.slots[:, :n].clone(),
            namespace=req.namespace,
        )
        self.prefix_cache.lock(node)
        req._locked.append(node)
        return n

    def finish_request(self, req: RequestKV, cache: bool = True) -> None:
        """End ``req``. With ``cache=True``, store it in the prefix cache first: the leading
        intact run in the shared namespace; the whole sequence with its holes and quantized
        cells in the session namespace when it has any (and a session id). Then drop the
        request's references and locks. Raises ``RuntimeError`` when called twice."""
        self._check_live(req)
        sm = req.slot_map
        t = len(sm)
        if cache and t > 0:
            tokens = torch.tensor(req.token_ids[:t])
            intact = sm.intact_prefix_len()
            if intact > 0:
                self.prefix_cache.insert(
                    tokens[:intact], sm.slots[:, :intact].clone(), namespace=req.namespace
                )
            if intact < t and req.session_id is not None:
                self.prefix_cache.insert(
                    tokens, sm.slots.clone(), session_id=req.session_id, namespace=req.namespace
                )
        self.allocator.decref(sm.slots)
        for node in req._locked:
            self.prefix_cache.unlock(node)
        req._locked.clear()
        req.finished = True
        del self._requests[req.request_id]

    def end_session(self, session_id: str, namespace: str | None = None) -> int:
        """Drop the session's prefix-cache namespace; returns cells freed. In-flight requests
        of the session keep their KV (their own references)."""
        return self.prefix_cache.end_session(session_id, namespace)

    def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache namespace; returns cells freed."""
        return self.prefix_cache.flush()

    def evict_prefix_cache(self, num_cells: int) -> int:
        """LRU-evict unlocked prefix-cache leaves until ``num_cells`` cells are freed or none
        is left; returns cells freed."""
        return self.prefix_cache.evict(num_cells)

    # ------------------------------------------------------------------ KV
    def write_kv(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K, V (``[n, Hkv, D]``) of ``layer`` into full-precision ``cells``: the
        layer's rows of :meth:`extend`'s result, int64 ``[Hkv, n]``."""
        self.pool.write(layer, cells, k, v)

    def layer_cells(self, cells: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of ``layer`` in a ``[L * Hkv, n]`` cell tensor: ``[Hkv, n]``."""
        h = self.num_kv_heads
        return cells[layer * h : (layer + 1) * h]

    def read_kv(
        self, req: RequestKV, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """K/V that ``layer`` of ``req`` attends to, dequantized, positions with no live cell
        in the layer dropped.

        Returns ``(k, v, positions, head_mask)`` on the pool device: ``k``, ``v``
        ``[n, Hkv, D]`` in the pool dtype (zeros where a head's cell is DEAD); ``positions``
        int64 ``[n]`` logical positions (ascending); ``head_mask`` bool ``[Hkv, n]`` (``True``
        = KV head may attend to that key) or ``None`` when all heads see all ``n`` keys.
        """
        cells = req.slot_map.layer_slots(layer)
        live = cells != DEAD
        keep = live.any(dim=0)
        pos = torch.nonzero(keep).reshape(-1)
        sel = cells[:, pos]
        k, v = self.pool.gather(layer, sel)
        hm = live[:, pos]
        head_mask = None if bool(hm.all()) else hm.to(self.pool.device)
        return k, v, pos.to(self.pool.device), head_mask

    # ------------------------------------------------------------ eviction
    def evict(self, req: RequestKV, positions: Sequence[int] | torch.Tensor) -> EvictResult:
        """Evict logical ``positions`` (int64 ``[k]``) of ``req`` in every layer and head."""
        self._check_live(req)
        released = req.slot_map.evict(positions)  # (what the positions held: all DEAD now)
        return self._release(req, *self._window_counts(released), released)

    def evict_per_head(
        self, req: RequestKV, keep_mask: torch.Tensor, start: int = 0
    ) -> EvictResult:
        """Evict per (layer, KV head): ``keep_mask`` bool ``[L, Hkv, T']`` over positions
        ``start .. start + T' - 1``, ``False`` = evict that cell (its bytes go back to that
        column's free list). Costs ``O(columns x T')`` on the host: a decode-time pass over a
        window does not pay for the whole map."""
        self._check_live(req)
        t = int(keep_mask.shape[-1])
        win = req.slot_map.slots[:, start : start + t]
        before_live, before_res = self._window_counts(win)
        released = req.slot_map.evict_cells(keep_mask, start)
        after_live, after_res = self._window_counts(win)
        return self._release(req, before_live - after_live, before_res - after_res, released)

    @staticmethod
    def _window_counts(cells: torch.Tensor) -> tuple[int, int]:
        """``(live cells, positions with a live cell)`` of ``cells [C, n]``: an eviction's
        counts from the positions it touched only."""
        live = cells != DEAD
        return int(live.sum()), int(live.any(dim=0).sum())

    # ----------------------------------------------------------- precision
    def set_precision(
        self,
        req: RequestKV,
        precision: torch.Tensor,
        int2_leftover: str = "int4",
        start: int = 0,
    ) -> PrecisionResult:
        """Quantize live full-precision cells of ``req`` as ``precision`` says.

        Args:
            precision: int8 :class:`Precision` values broadcastable to ``[L, Hkv, T']``
                for positions ``start .. start + T' - 1`` (``start + T' <= seq_len``; e.g.
                ``[T']`` per position or ``[L, 1, T']`` per layer). ``INT4`` / ``INT2``
                demote a live full-precision cell; ``FULL`` and ``EVICTED`` leave it (evict
                first with :meth:`evict_per_head`). Quantized cells never move back to full
                precision.
            int2_leftover: INT2 cells are quantized per column in pages of 32 (position
                order, within the window); the ``< 32`` that do not fill a page go to INT4
                (``"int4"``, as TriAxialKV does) or stay at full precision until a later
                call fills the page (``"full"``, for decode).
            start: first position ``precision`` covers. A decode-time page passes its own
                32 positions so the call reads ``O(page)`` of the map, not ``O(seq_len)``.

        Raises :class:`OutOfSlots` when a column's quantized pool has no room even after
        evicting the prefix cache.
        """
        self._check_live(req)
        sm = req.slot_map
        L, H = self.num_layers, self.num_kv_heads
        t = int(precision.shape[-1])
        if start < 0 or start + t > len(sm):
            raise ValueError(
                f"precision covers positions {start}..{start + t - 1} but the request has {len(sm)}"
            )
        prec = torch.as_tensor(precision, dtype=torch.int8).to("cpu")
        prec = prec.expand(L, H, t).reshape(L * H, t)
        full = sm.full_precision(start, start + t)
        to4 = full & (prec == int(Precision.INT4))
        to2 = full & (prec == int(Precision.INT2))
        if not bool(to4.any()) and not bool(to2.any()):
            return PrecisionResult(0, 0, 0)
        # INT2 pages: per column, the INT2-bound cells in position order, 32 at a time
        page_cols, page_pos = [], []
        counts = to2.sum(dim=1)
        for c in torch.nonzero(counts).reshape(-1).tolist():
            pos = torch.nonzero(to2[c]).reshape(-1)
            n_full = (pos.numel() // INT2_PAGE) * INT2_PAGE
            rest = pos[n_full:]
            if rest.numel():
                to2[c, rest] = False
                if int2_leftover == "int4":
                    to4[c, rest] = True
            if n_full:
                page_pos.append(pos[:n_full].view(-1, INT2_PAGE))
                page_cols.append(torch.full((n_full // INT2_PAGE,), c, dtype=torch.int64))
        n4 = int(to4.sum())
        n2p = sum(int(p.shape[0]) for p in page_pos)
        self._reserve_quantized(to4.sum(dim=1), counts // INT2_PAGE)
        freed = 0
        if n4:
            cols, pos = torch.nonzero(to4, as_tuple=True)
            pos = pos + start
            new = self.allocator.alloc_int4(cols)
            old = sm.slots[cols, pos]
            self._demote(cols, old, new, Precision.INT4)
            sm.replace(cols, pos, new)
            freed += self.allocator.decref_pairs(cols, old)
        if n2p:
            cols = torch.cat(page_cols)
            pos = torch.cat(page_pos) + start  # [P, 32]
            rows = self.allocator.alloc_int2_pages(cols)  # [P, 32]
            old = sm.slots[cols[:, None], pos]
            self._demote(cols, old, rows, Precision.INT2)
            c32 = cols[:, None].expand_as(pos).reshape(-1)
            sm.replace(c32, pos.reshape(-1), rows.reshape(-1))
            freed += self.allocator.decref_pairs(c32, old.reshape(-1))
        return PrecisionResult(n4, n2p * INT2_PAGE, freed)

    def _demote(self, cols: torch.Tensor, old: torch.Tensor, new: torch.Tensor, p: Precision):
        h = self.num_kv_heads
        self.pool.demote(cols // h, cols % h, old, new, p)

    def compact_int4(self, req: RequestKV, min_density: float | None = None) -> CompactionResult:
        """Move ``req``'s INT4 cells into fuller runs where per-token eviction left them sparse.

        The decode kernel reads a KV head's INT4 rows fastest when a block of positions lies
        on consecutive rows; after eviction, a demoted span's surviving cells are scattered
        over part-empty 32-cell runs. A cell may move when every holder is known: the
        request's map and, for a matched prefix, the session node of the request's locked
        path that stores the same cell at that position (a cell anyone else holds, e.g. a
        sibling request, stays: moving it would duplicate it). In every column where such
        cells fill less than ``min_density`` (default ``int4_min_density``) of the runs they
        touch, they are copied bit for bit into cells of the column's fullest free runs
        (:meth:`SlotAllocator.compact_int4`), the map and the nodes repointed and the old
        cells freed. Positions, precisions and values are unchanged, and so are resident
        bytes; a column without enough free runs is left as it is. Rebuild any
        :class:`DecodeIndex` of ``req`` afterwards (its cell ids changed).

        Only looks when an eviction dropped INT4 cells of ``req`` since the last call
        (``req.int4_thinned``): the check reads every INT4 cell of the map (host time)."""
        self._check_live(req)
        d = self.int4_min_density if min_density is None else float(min_density)
        if d <= 0.0 or not req.int4_thinned:
            return CompactionResult(0, 0)
        req.int4_thinned = False
        sm = req.slot_map
        slots = sm.slots
        lay = self.layout
        is4 = (slots >= lay.int4_base) & (slots < lay.int2_base)
        if not bool(is4.any()):
            return CompactionResult(0, 0)
        # the holders this call repoints: the map, and the locked path's nodes where they
        # store the map's cell
        nodes = self._path_nodes(req)
        holders = torch.ones_like(slots, dtype=torch.int32)
        for start, node in nodes:
            n = min(len(node), len(sm) - start)
            if n > 0:
                holders[:, start : start + n] += (
                    node.value[:, :n] == slots[:, start : start + n]
                ).int()
        movable = is4 & (self.allocator.refcount(slots) == holders)
        cols, pos = torch.nonzero(movable, as_tuple=True)
        old = slots[cols, pos]
        new = self.allocator.compact_int4(cols, old, d)
        moved = new != old
        if not bool(moved.any()):
            return CompactionResult(0, 0)
        cols, pos, old, new = cols[moved], pos[moved], old[moved], new[moved]
        h = self.num_kv_heads
        self.pool.move_int4(cols // h, cols % h, old, new)
        sm.replace(cols, pos, new)
        self.allocator.decref_pairs(cols, old)
        for start, node in nodes:
            at = (pos >= start) & (pos < start + len(node))
            at[at.clone()] = node.value[cols[at], pos[at] - start] == old[at]
            if bool(at.any()):
                node.value[cols[at], pos[at] - start] = new[at]
                self.allocator.incref_pairs(cols[at], new[at])
                self.allocator.decref_pairs(cols[at], old[at])
        return CompactionResult(int(torch.unique(cols).numel()), int(cols.numel()))

    def _path_nodes(self, req: RequestKV) -> list[tuple[int, TreeNode]]:
        """``(start position, node)`` of every node on the request's locked paths (the
        matched prefix's, and those ``cache_unfinished_request`` inserted), roots excluded."""
        seen: dict[int, tuple[int, TreeNode]] = {}
        for last in req._locked:
            chain = []
            node = last
            while node is not None and node.parent is not None:
                chain.append(node)
                node = node.parent
            start = 0
            for node in reversed(chain):
                seen.setdefault(id(node), (start, node))
                start += len(node)
        return list(seen.values())

    def calibrate_key_channels(self, req: RequestKV, statistic: str = "absmax") -> None:
        """Set every layer's INT4 key channel scales (:meth:`KVPool.set_key_channel_scales`)
        from the full-precision keys of ``req`` (a calibration prompt, before any request is
        quantized): the channel's largest magnitude (``"absmax"``) or its root mean square
        (``"rms"``), both without the first 4 tokens (attention sinks carry atypical keys)."""
        if statistic not in ("absmax", "rms"):
            raise ValueError(f"statistic must be 'absmax' or 'rms', got {statistic!r}")
        for layer in range(self.num_layers):
            k, _v, _pos, _hm = self.read_kv(req, layer)  # [n, Hkv, D]
            k = k.float()[4:] if k.shape[0] > 8 else k.float()
            stat = k.abs().amax(dim=0) if statistic == "absmax" else k.pow(2).mean(0).sqrt()
            self.pool.set_key_channel_scales(layer, stat)

    # ----------------------------------------------------------- telemetry
    def request_stats(self, req: RequestKV) -> RequestKVStats:
        """Telemetry of one request."""
        sm = req.slot_map
        resident = sm.num_resident
        prec = self.layout.precision(sm.slots)
        cells = {p.label: int((prec == int(p)).sum()) for p in (Precision.FULL, *QUANTIZED)}
        cb = self.pool.cell_bytes
        by_prec = {p.label: int(round(cells[p.label] * cb[p])) for p in cb}
        return RequestKVStats(
            seq_len=len(sm),
            num_cached=req.num_cached,
            resident_slots=resident,
            dead_positions=len(sm) - resident,
            live_kv_entries=sm.live_entries(),
            effective_live_tokens=sm.effective_live_tokens(),
            resident_bytes=sum(by_prec.values()),
            resident_bytes_by_precision=by_prec,
            cells_by_precision=cells,
            effective_bytes=int(round(sm.effective_live_tokens() * self.pool.bytes_per_token)),
            slot_map_bytes=8 * self.num_columns * len(sm),
        )

    def stats(self) -> KVStoreStats:
        """Store-wide telemetry."""
        a, bpt = self.allocator, self.pool.bytes_per_token
        used = a.used_cells()
        cb = self.pool.cell_bytes
        by_prec = {p.label: int(round(used[p] * cb[p])) for p in used}
        reqs = list(self._requests.values())
        return KVStoreStats(
            capacity=a.capacity,
            free_slots=a.free_count,
            used_slots=round(used[Precision.FULL] / self.num_columns),
            bytes_per_token=bpt,
            used_bytes=sum(by_prec.values()),
            used_bytes_by_precision=by_prec,
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

        For tests and debug runs. Checks: each cell's count equals the number of request maps
        and prefix-cache nodes holding it; each column's free lists are exactly its
        unreferenced cells (INT2: pages with no referenced row), without repeats or DEAD;
        the shared namespace holds only intact full-precision cells; a cell sits at one
        logical position wherever it is held; lock counts match the in-flight requests.
        Raises :class:`SlotRefcountError` on a violation.
        """
        lay = self.layout
        C, U = self.num_columns, lay.num_ids
        expected = torch.zeros(C * U, dtype=torch.int32)
        where = torch.full((C * U,), -1, dtype=torch.int64)
        col_of = torch.arange(C)[:, None]

        def hold(cells: torch.Tensor, start: int, what: str) -> None:
            pos = torch.arange(start, start + int(cells.shape[1]))[None, :].expand_as(cells)
            live = cells != DEAD
            flat = (col_of.expand_as(cells) * U + cells)[live]
            p = pos[live]
            expected.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
            seen = where[flat]
            clash = (seen >= 0) & (seen != p)
            if bool(clash.any()):
                raise SlotRefcountError(f"{what}: cell(s) moved position")
            where[flat] = p

        for req in self._requests.values():
            hold(req.slot_map.slots, 0, f"request {req.request_id}")
        for sid, start, node in self.prefix_cache.iter_nodes():
            hold(node.value, start, f"prefix-cache node of {sid!r}")
            if sid is None and not self.prefix_cache._intact(node.value):
                raise SlotRefcountError("the shared namespace holds a hole or a quantized cell")
        rc = self.allocator.refcount().view(-1)
        if bool((rc != expected).any()):
            bad = torch.nonzero(rc != expected).reshape(-1)[:8]
            raise SlotRefcountError(
                f"refcount mismatch at cells {(bad % U).tolist()}: counted "
                f"{expected[bad].tolist()}, allocator has {rc[bad].tolist()}"
            )
        rc2 = rc.view(C, U)
        if bool((rc2[:, DEAD] != 0).any()):
            raise SlotRefcountError("the dead slot holds a reference")
        for c in range(C):
            for prec, lo, hi in (
                (Precision.FULL, 1, lay.int4_base),
                (Precision.INT4, lay.int4_base, lay.int2_base),
            ):
                free = self.allocator.free_ids(c, prec)
                unref = lo + torch.nonzero(rc2[c, lo:hi] == 0).reshape(-1)
                if free.numel() != unref.numel() or not torch.equal(free.sort().values, unref):
                    raise SlotRefcountError(
                        f"column {c}: the {prec.label} free list is not the unreferenced cells"
                    )
            if lay.int2_pages:
                pages = rc2[c, lay.int2_base :].view(lay.int2_pages, INT2_PAGE)
                unref = torch.nonzero((pages == 0).all(dim=1)).reshape(-1)
                free = self.allocator.free_ids(c, Precision.INT2)
                if free.numel() != unref.numel() or not torch.equal(free.sort().values, unref):
                    raise SlotRefcountError(f"column {c}: the INT2 free pages are wrong")
        roots = {id(r) for r in self.prefix_cache.roots()}
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
        a = self.allocator
        if n > a.free_count:
            self.prefix_cache.evict_until(lambda _freed: a.free_count >= n)
        if n > a.free_count:
            raise OutOfSlots(
                f"need {n} KV cells per (layer, head), {a.free_count} free of {a.capacity} "
                f"after evicting every unlocked prefix-cache node; {len(self._requests)} "
                "requests in flight hold the rest"
            )

    def _reserve_quantized(self, int4: torch.Tensor, int2_pages: torch.Tensor) -> None:
        a = self.allocator

        def enough(_freed: int = 0) -> bool:
            return bool((a.free_cells(Precision.INT4) >= int4).all()) and bool(
                (a.free_cells(Precision.INT2) >= int2_pages).all()
            )

        if not enough():
            self.prefix_cache.evict_until(enough)
        if not enough():
            raise OutOfSlots(
                "the quantized pools are full: need up to "
                f"{int(int4.max())} INT4 cells and {int(int2_pages.max())} INT2 pages in a "
                f"column, layout {self.layout}"
            )

    def _release(
        self, req: RequestKV, entries: int, positions: int, released: torch.Tensor
    ) -> EvictResult:
        lay = self.layout
        if bool(((released >= lay.int4_base) & (released < lay.int2_base)).any()):
            req.int4_thinned = True
        freed = self.allocator.decref(released)
        return EvictResult(entries, positions, freed, released)
