"""transformers integration: a ``Cache`` backed by the KV store + the ``agentkv`` attention.

One forward pass of the embedded engine computes ``n`` new positions of one request:

- :class:`StoreCache.update` (called by every attention layer with the new post-RoPE K/V)
  writes them into the request's slots in the pool and returns the K/V of every position the
  layer still attends to (DEAD dropped), from the request's :class:`LiveView`, remembering
  their logical positions and per-head mask;
- :func:`agentkv_attention` (registered with transformers' ``AttentionInterface`` as
  ``"agentkv"``) builds the causal mask from logical positions, not from indices, so holes
  left by eviction are invisible, applies per-KV-head masks, and feeds the method's prefill
  observer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from agentkv.cache import DEAD, KVStore, RequestKV
from agentkv.engine.kernel_decode import KernelDecode
from agentkv.methods import PrefillObserver

ATTN_NAME = "agentkv"
CACHE_KWARG = "agentkv_cache"

#: SDPA backends for the engine's masked attention. Not cuDNN: with a boolean mask, torch
#: 2.11 on an H100 picks cuDNN attention, which builds a graph for every new (queries, keys)
#: shape (50-1,300 ms each, then 0.15 ms); an engine sees a new shape at almost every request,
#: so SnapKV / H2O / KVzap requests took 3-7 s instead of 0.3 s (benchmarks.md §6d).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


#: rows a layer's view grows by, at least, when it is full (and a quarter of its length): a
#: decode step writes its row in place instead of copying the whole view
VIEW_GROWTH_MIN = 256


@dataclass
class LayerView:
    """One layer's attended K/V, in buffers with room to grow: rows ``[:n]`` are the view.

    Attributes:
        k, v: ``[cap, Hkv, D]`` keys / values (the pool dtype).
        positions: int64 ``[cap]`` logical positions, ascending over ``[:n]``.
        head_mask: bool ``[Hkv, cap]`` (True = the KV head attends to that key), or None when
            every head sees every key.
        n: rows in use.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    head_mask: torch.Tensor | None
    n: int

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows ``k_new``/``v_new`` ``[m, Hkv, D]`` at ``positions`` ``[m]`` after row ``n``
        (written in place; the buffers grow by a quarter, at least ``VIEW_GROWTH_MIN`` rows,
        when full: amortized O(m) a call instead of a copy of the whole view)."""
        n, m = self.n, k_new.shape[0]
        if n + m > self.k.shape[0]:
            self._grow(n + m + max(VIEW_GROWTH_MIN, n // 4))
        self.k[n : n + m] = k_new
        self.v[n : n + m] = v_new
        self.positions[n : n + m] = positions
        if self.head_mask is not None:
            self.head_mask[:, n : n + m] = True
        self.n = n + m

    def _grow(self, cap: int) -> None:
        n = self.n

        def grown(x: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(x.shape)
            shape[dim] = cap
            out = x.new_empty(shape)
            out.narrow(dim, 0, n).copy_(x.narrow(dim, 0, n))
            return out

        self.k, self.v = grown(self.k, 0), grown(self.v, 0)
        self.positions = grown(self.positions, 0)
        if self.head_mask is not None:
            self.head_mask = grown(self.head_mask, 1)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The view: ``(k [n, Hkv, D], v, positions [n], head_mask [Hkv, n] | None)``."""
        n = self.n
        hm = None if self.head_mask is None else self.head_mask[:, :n]
        return self.k[:n], self.v[:n], self.positions[:n], hm


class LiveView:
    """The K/V one request attends to, per layer: gathered from the store once (DEAD dropped),
    then appended to as the request computes new positions (:class:`LayerView`).

    Valid while the request's slot map only grows (prefill chunks, decode steps, teacher
    forcing, forks); build a new view after applying a plan. Saves re-gathering every live
    key at every step.
    """

    def __init__(self, store: KVStore, req: RequestKV):
        self.store = store
        self.req = req
        self._layers: dict[int, LayerView] = {}

    def _base(self, layer: int, before: int) -> LayerView:
        view = self._layers.get(layer)
        if view is None:
            k, v, pos, head_mask = self.store.read_kv(self.req, layer)
            end = int(torch.searchsorted(pos, torch.tensor(before, device=pos.device)))
            hm = None if head_mask is None else head_mask[:, :end]
            view = self._layers[layer] = LayerView(k[:end], v[:end], pos[:end], hm, end)
        return view

    def follow_page(self, start: int, end: int) -> LiveView:
        """Positions ``start .. end - 1`` were just re-quantized in place (a decode-time page:
        new cells, nothing evicted): re-read those rows of every layer gathered so far from
        the store, ``O(page)``, instead of a new view re-gathering every live key. Returns
        this view, then equal to a new one."""
        with torch.inference_mode():  # (the views were made in forward passes)
            self._follow_page(start, end)
        return self

    def _windows(
        self, start: int, end: int
    ) -> Iterator[tuple[int, LayerView, torch.Tensor, torch.Tensor]]:
        """Per layer gathered so far that holds any of positions ``start .. end - 1``: the
        layer, its view, its rows of them (int64 ``[m]``; a position no head kept has none) and those
        positions' cells in the slot map now (``[Hkv, m]``)."""
        for layer, view in self._layers.items():
            n = view.n
            if n == 0:
                continue
            pos = view.positions[:n]
            want = torch.arange(start, end, device=pos.device)
            rows = torch.searchsorted(pos, want).clamp_max(n - 1)
            present = pos[rows] == want
            if not bool(present.any()):
                continue
            cells = self.req.slot_map.layer_slots(layer)[:, start:end][:, present.cpu()]
            yield layer, view, rows[present], cells

    def _follow_page(self, start: int, end: int) -> None:
        for layer, view, rows, cells in self._windows(start, end):
            k, v = self.store.pool.gather(layer, cells)  # [w, Hkv, D], DEAD: zero rows
            view.k[rows] = k
            view.v[rows] = v

    def follow_eviction(self, start: int, end: int) -> LiveView:
        """Cells of positions ``start .. end - 1`` were just evicted (a decode-time pruning
        pass: nothing else changed): in every layer gathered so far, a row whose position no
        head keeps leaves the view (the rows after it move up: ``O(rows after start)``) and
        the others' head masks follow the map, instead of a new view re-gathering every
        live key. Returns this view, then attending as a new one does."""
        with torch.inference_mode():  # (the views were made in forward passes)
            self._follow_eviction(start, end)
        return self

    def _follow_eviction(self, start: int, end: int) -> None:
        for _, view, rows, cells in self._windows(start, end):
            n, dev = view.n, view.positions.device
            live = (cells != DEAD).to(dev)  # [Hkv, m]
            kept = live.any(dim=0)
            gone = ~live[:, kept].T  # [m', Hkv]: a kept row's evicted heads
            if bool(gone.any()):
                if view.head_mask is None:
                    view.head_mask = torch.ones(
                        live.shape[0], view.k.shape[0], dtype=torch.bool, device=dev
                    )
                rk = rows[kept]
                view.head_mask[:, rk] = ~gone.T
                for buf in (view.k, view.v):  # (zeros, as a gather reads a DEAD cell)
                    buf[rk] = buf[rk].masked_fill(gone[:, :, None], 0)
            if bool(kept.all()):
                continue
            first = int(rows[~kept].min())
            stay = torch.ones(n - first, dtype=torch.bool, device=dev)
            stay[rows[~kept] - first] = False
            src = first + torch.nonzero(stay).reshape(-1)
            m = first + src.numel()
            view.k[first:m] = view.k[src]
            view.v[first:m] = view.v[src]
            view.positions[first:m] = view.positions[src]
            if view.head_mask is not None:
                view.head_mask[:, first:m] = view.head_mask[:, src]
            view.n = m

    def extend(
        self,
        layer: int,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        positions: torch.Tensor,
        first: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append ``k_new``/``v_new`` ``[n, Hkv, D]`` at ``positions`` ``[n]`` (``first`` =
        ``positions[0]`` as an int, so no device sync is needed); returns the
        whole view ``(k [m, Hkv, D], v, positions [m], head_mask [Hkv, m] | None)``."""
        view = self._base(layer, first)
        view.append(k_new, v_new, positions)
        return view.rows()


class StoreCache(Cache):
    """A transformers ``Cache`` for one forward pass over the KV store.

    Args:
        view: the request's :class:`LiveView` (the keys attended, extended by this pass).
        positions: int64 ``[n]`` logical positions of the new tokens (ascending).
        write_slots: int64 ``[L * Hkv, n]`` cells of the new positions (from
            ``KVStore.extend``); None for a fork whose K/V lives only in the view (nothing
            written to the store).
        observer: the method's prefill observer, or None.
        kernel: decode through the fused kernel (one new position; the view is not used).
        seq_length: what :meth:`get_seq_length` answers when ``positions`` lie on the device
            (a step captured in a CUDA graph, which must not read them on the host; kernel
            decode only). Default: ``positions[-1] + 1``, read from CPU ``positions``.
    """

    is_compileable = False

    def __init__(
        self,
        view: LiveView,
        positions: torch.Tensor,
        write_slots: torch.Tensor | None = None,
        observer: PrefillObserver | None = None,
        kernel: KernelDecode | None = None,
        seq_length: int | None = None,
    ):
        super().__init__(layers=[])
        self.kernel = kernel
        self.view = view
        self.store = view.store
        device = self.store.pool.device
        self.write_slots = None if write_slots is None else write_slots.to(device)
        if seq_length is not None:  # device positions: never read on the host
            if kernel is None:
                raise ValueError("seq_length= is for kernel decode (device positions)")
            self.first_position, self._seq_length = -1, seq_length
        else:  # CPU ints: no device sync per layer (nor per forward, in get_seq_length)
            self.first_position = int(positions[0])
            self._seq_length = int(positions[-1]) + 1
        self.positions = positions.to(device)
        self.observer = observer
        self.key_positions: dict[int, torch.Tensor] = {}
        self.head_masks: dict[int, torch.Tensor | None] = {}
        self._attended: list[float | torch.Tensor] = []

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states``/``value_states`` ``[1, Hkv, n, D]`` -> attended K/V ``[1, Hkv, m, D]``.

        The rest is ignored: ``cache_kwargs`` (transformers <= 5.23, positional) or the
        attention layer's ``kwargs=`` (5.24 on), which hold nothing the store needs."""
        k_new = key_states[0].transpose(0, 1)
        v_new = value_states[0].transpose(0, 1)
        if self.kernel is not None:  # the kernel reads the pools: write, nothing to gather
            assert self.write_slots is not None, "kernel decode writes to the store"
            self.store.write_kv(
                layer_idx, self.store.layer_cells(self.write_slots, layer_idx), k_new, v_new
            )
            return key_states, value_states
        self.view._base(layer_idx, self.first_position)  # gather before writing
        if self.write_slots is not None:
            self.store.write_kv(
                layer_idx, self.store.layer_cells(self.write_slots, layer_idx), k_new, v_new
            )
        k, v, pos, head_mask = self.view.extend(
            layer_idx, k_new, v_new, self.positions, self.first_position
        )
        m = pos.numel()
        self._attended.append(m if head_mask is None else head_mask.float().mean() * m)
        self.key_positions[layer_idx] = pos
        self.head_masks[layer_idx] = head_mask
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    @property
    def attended_keys(self) -> float:
        """Keys attended per layer, summed over layers (mask-weighted): the reads metric.
        Read after the forward pass (one device sync for all layers)."""
        ints = sum(a for a in self._attended if not isinstance(a, torch.Tensor))
        tensors = [a for a in self._attended if isinstance(a, torch.Tensor)]
        return float(ints) + (float(torch.stack(tensors).sum()) if tensors else 0.0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length

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
    if cache.kernel is not None:
        return cache.kernel.attend(layer, query, scaling), None
    k_pos = cache.key_positions[layer]
    head_mask = cache.head_masks[layer]
    q_pos = cache.positions
    _, hq, n, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    if cache.observer is not None:
        cache.observer.observe(layer, query[0], q_pos, key[0], k_pos, head_mask)
    # GQA as extra query rows: the `group` query heads of a KV head attend together, so K/V are
    # read once and never expanded ([1, Hkv, group * n, D] queries).
    qg = query.reshape(1, hkv, group * n, d)
    mask = None
    # one query sees every key of the view (all at positions <= its own): no mask, no sync
    if n > 1:
        mask = (k_pos[None, :] <= q_pos[:, None]).repeat(group, 1)[None, None]
    if head_mask is not None:
        hm = head_mask[None, :, None, :]
        mask = hm if mask is None else mask & hm
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qg, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(1, hq, n, d).transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register :func:`agentkv_attention` as transformers attention implementation ``agentkv``."""
    AttentionInterface.register(ATTN_NAME, agentkv_attention)
