"""The store's KV memory: for every layer, the kernels' mixed-precision pools.

One model of storage for the store and the kernels: layer ``l`` is one
:class:`agentkv.kernels.KVPools` (full precision in the model dtype, INT4 token rows, INT2
pages of 32 rows) in one unified slot-id address space (:class:`PoolLayout`), with DEAD = row 0
of the full pool. A cell is (unified id, KV head): every (layer, head) column allocates its
own cells (:class:`SlotAllocator`), so K/V buffers ``[rows, Hkv, ...]`` are shared by columns
only as storage, never as a unit of allocation.

Quantization happens once, on the write path (:meth:`KVPool.demote`): a full-precision cell
is quantized into a fresh INT4 cell or, 32 cells of a column at a time, into an INT2 page;
the full cell is then released. No full-precision copy is kept.

Each buffer of every layer is one view ``[l]`` of a tensor stacked over layers
(:class:`PoolStack`), so a demotion or a move that touches many layers (a decode-time page
touches all of them) is a handful of indexed ops, not a handful per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentkv.cache.precision import Precision
from agentkv.cache.slot_allocator import PoolLayout
from agentkv.kernels import (
    GROUP_SIZE,
    INT2_PAGE,
    SCALE_DTYPE,
    FullPool,
    Int2Pool,
    Int4Pool,
    KVPools,
    check_head_dim,
    dequant_gather,
    quantize_int2_keys_ref,
    quantize_int2_values_ref,
    quantize_int4_ref,
    write_full,
)
from agentkv.kernels.backend import Backend

#: cells quantized per batch of :meth:`KVPool.demote`, by device type: few launches on a GPU
#: (a chunk's float temporaries ~100 MB at D = 128), cache-sized batches on the CPU (SmolLM2's
#: shape: 2^14 ~600-700 ns a cell, 2^18 ~1.6-2.8 µs)
DEMOTE_CHUNK_CELLS = {"cuda": 1 << 18, "cpu": 1 << 14}


@dataclass
class PoolStack:
    """Every layer's pool buffers, stacked over layers (layer ``l``'s tensors are views
    ``[l]``; ``None`` where the layout has no such pool). Shapes, ``L`` layers, ``S`` full
    slots, ``S4`` INT4 slots, ``P`` INT2 pages, ``ng = D / 32``:

    - ``full_k``, ``full_v``: ``[L, S, Hkv, D]`` model dtype;
    - ``int4_k``, ``int4_v``: ``[L, Hkv, S4, D / 2]`` uint8 (head-major rows);
    - ``int4_scales``: ``[L, Hkv, S4, 4, ng]`` fp16, each row's ``[ks | kz | vs | vz]``;
    - ``int2_k``, ``int2_v``: ``[L, P, Hkv, 32, D / 4]`` uint8;
    - ``int2_k_scale``, ``int2_k_zero``: ``[L, P, Hkv, D]`` fp16 (per channel over a page);
    - ``int2_v_scale``, ``int2_v_zero``: ``[L, P, Hkv, 32, ng]`` fp16;
    - ``k_channel``: ``[L, Hkv, D]`` fp32 INT4 key channel scales, ones for a layer without
      (made by the first :meth:`KVPool.set_key_channel_scales`).
    """

    full_k: torch.Tensor
    full_v: torch.Tensor
    int4_k: torch.Tensor | None = None
    int4_v: torch.Tensor | None = None
    int4_scales: torch.Tensor | None = None
    int2_k: torch.Tensor | None = None
    int2_v: torch.Tensor | None = None
    int2_k_scale: torch.Tensor | None = None
    int2_k_zero: torch.Tensor | None = None
    int2_v_scale: torch.Tensor | None = None
    int2_v_zero: torch.Tensor | None = None
    k_channel: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layout: PoolLayout,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PoolStack:
        """Zero-filled buffers of ``layout``'s sizes."""
        L, H, D = num_layers, num_kv_heads, head_dim

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(L, *shape, dtype=dtype, device=device)

        st = cls(
            zeros(layout.full_slots, H, D, dtype=dtype), zeros(layout.full_slots, H, D, dtype=dtype)
        )
        ng = D // GROUP_SIZE
        u8, f16 = torch.uint8, SCALE_DTYPE
        if layout.int4_slots:
            s4 = layout.int4_slots
            st.int4_k, st.int4_v = zeros(H, s4, D // 2, dtype=u8), zeros(H, s4, D // 2, dtype=u8)
            st.int4_scales = zeros(H, s4, 4, ng, dtype=f16)
        if layout.int2_pages:
            p = layout.int2_pages
            st.int2_k = zeros(p, H, INT2_PAGE, D // 4, dtype=u8)
            st.int2_v = zeros(p, H, INT2_PAGE, D // 4, dtype=u8)
            st.int2_k_scale, st.int2_k_zero = zeros(p, H, D, dtype=f16), zeros(p, H, D, dtype=f16)
            st.int2_v_scale = zeros(p, H, INT2_PAGE, ng, dtype=f16)
            st.int2_v_zero = zeros(p, H, INT2_PAGE, ng, dtype=f16)
        return st

    def layer(self, layer: int) -> KVPools:
        """Layer ``layer``'s pools, views of the stacked buffers (the INT4 pool head-major,
        its four scale vectors interleaved: :meth:`Int4Pool.from_buffers`, as
        ``Int4Pool.allocate(head_major=True)`` lays it)."""
        full = FullPool(self.full_k[layer], self.full_v[layer])
        int4 = int2 = None
        if self.int4_k is not None:
            int4 = Int4Pool.from_buffers(
                self.int4_k[layer], self.int4_v[layer], self.int4_scales[layer], head_major=True
            )
        if self.int2_k is not None:
            int2 = Int2Pool(
                self.int2_k[layer],
                self.int2_v[layer],
                self.int2_k_scale[layer],
                self.int2_k_zero[layer],
                self.int2_v_scale[layer],
                self.int2_v_zero[layer],
            )
        return KVPools(full, int4, int2)


class KVPool:
    """K/V pools of every layer.

    ``layers[l]`` is layer ``l``'s :class:`KVPools`, views of :attr:`stack` (one tensor per
    buffer over all layers). Each layer's INT4 pool is head-major, as
    ``Int4Pool.allocate(head_major=True)`` lays it: a (layer, KV head) column's cells are
    consecutive rows of its own run, and the allocator hands a
    demoted span out in runs of consecutive cells (``SlotAllocator.alloc_int4``), so the
    decode kernel reads each head's 32-position blocks as whole 2 KB runs (H200: INT4
    decode 7-15% faster than over slot-major rows, docs/benchmarks.md §3, session 26).

    Args:
        num_layers: ``L``.
        num_kv_heads: ``Hkv``.
        head_dim: ``D`` (a power of two, multiple of 32, when quantized pools exist).
        layout: pool sizes (:class:`PoolLayout`).
        dtype: full-precision dtype (the model's).
        device: where the buffers live.
        backend: kernels backend for gathers (``"torch"`` on CPU, ``"triton"`` on CUDA by
            default; ``"auto"`` follows :func:`agentkv.kernels.resolve_backend`).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        layout: PoolLayout,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: Backend | None = None,
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, num_kv_heads, head_dim >= 1 required")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.backend: Backend = backend or ("triton" if self.device.type == "cuda" else "torch")
        if layout.int4_slots or layout.int2_pages:
            check_head_dim(head_dim)  # before allocating
        self.stack = PoolStack.allocate(
            num_layers, num_kv_heads, head_dim, layout, dtype, self.device
        )
        self.layers = [self.stack.layer(layer) for layer in range(num_layers)]

    # ------------------------------------------------------------------ sizes
    @property
    def cell_bytes(self) -> dict[Precision, float]:
        """Bytes of one cell (one token, one KV head, K and V, scales included) per precision."""
        d = self.head_dim
        ng = d // GROUP_SIZE if d % GROUP_SIZE == 0 else 0
        full = 2 * d * torch.empty((), dtype=self.dtype).element_size()
        int4 = 2 * (d // 2 + 2 * ng * 2)
        int2 = (d // 4 + 2 * d * 2 / INT2_PAGE) + (d // 4 + 2 * ng * 2)
        return {Precision.FULL: float(full), Precision.INT4: float(int4), Precision.INT2: int2}

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token at full precision over all layers and heads, K and V."""
        return int(self.cell_bytes[Precision.FULL] * self.num_layers * self.num_kv_heads)

    @property
    def total_bytes(self) -> int:
        """Bytes of every buffer of every layer (scales included)."""
        return sum(
            t.numel() * t.element_size()
            for p in self.layers
            for pool in (p.full, p.int4, p.int2)
            if pool is not None
            for t in vars(pool).values()
            if isinstance(t, torch.Tensor)
        )

    # --------------------------------------------------------------- access
    def write(self, layer: int, cells: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store full-precision K and V of ``n`` tokens.

        Args:
            layer: layer index.
            cells: int64 ``[Hkv, n]`` full-precision cell ids of each head (never DEAD), on
                any device.
            k, v: ``[n, Hkv, D]``, cast to the pool dtype.
        """
        # (one kernel for K and V on CUDA: batch-1 decode writes a row a head a layer)
        write_full(
            self.layers[layer].full, cells.to(self.device), k.to(self.device), v.to(self.device),
            backend=self.backend,
        )  # fmt: skip

    def gather(self, layer: int, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of ``cells`` (int64 ``[Hkv, n]``, any precision, DEAD = zero
        rows): two ``[n, Hkv, D]`` tensors in the pool dtype."""
        slots = cells.to(self.device).t()  # [n, Hkv] view
        # the default GatherConfig (the H100 winner): int32 [n, Hkv] rows read as given
        # (slot_rows), all KV heads of a token block in one program
        return dequant_gather(
            self.layers[layer], slots, out_dtype=self.dtype, backend=self.backend, per_head=True
        )

    def set_key_channel_scales(self, layer: int, key_absmax: torch.Tensor) -> None:
        """Outlier key channels: from the largest magnitude of each key channel of ``layer``
        (float ``[Hkv, D]``, measured on calibration text), store INT4 keys divided by a
        per-channel power of two (``2 ** floor(log2(absmax))``; exact in floating point, so
        the kernels fold it into the query at no precision cost). Per-token 32-channel groups
        then no longer take their range from a few large channels. Set it before anything
        is quantized (cells already quantized would be misread)."""
        p4 = self.layers[layer].int4
        if p4 is None:
            return
        st = self.stack
        if st.k_channel is None:  # ones: dividing by 1 leaves a layer without scales as is
            st.k_channel = torch.ones(
                self.num_layers, self.num_kv_heads, self.head_dim, device=self.device
            )
        a = key_absmax.float().to(self.device).clamp_min(1e-6)
        st.k_channel[layer] = torch.exp2(torch.floor(torch.log2(a)))
        p4.k_channel = st.k_channel[layer]

    def demote(
        self,
        layers: torch.Tensor,
        heads: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        precision: Precision,
    ) -> None:
        """Quantize full-precision cells into quantized ones (the write path of a demotion),
        every layer at once.

        Args:
            layers: int64 ``[m]`` layer of each cell (INT2: of each page).
            heads: int64 ``[m]`` KV head of each cell (INT2: of each page).
            src: int64 full-precision cell ids, ``[m]`` (INT4) or ``[m, 32]`` (INT2: the 32
                rows of one page, position order).
            dst: int64 ``[m]`` INT4 cell ids, or ``[m, 32]`` INT2 row ids of whole pages.
            precision: ``INT4`` or ``INT2``.
        """
        dev = self.device
        chunk = DEMOTE_CHUNK_CELLS.get(dev.type, DEMOTE_CHUNK_CELLS["cpu"])
        if precision == Precision.INT4:
            quantize, step = self._quantize_int4, chunk
        elif precision == Precision.INT2:
            quantize, step = self._quantize_int2_pages, chunk // INT2_PAGE
        else:
            raise ValueError(f"cannot demote to {precision!r}")
        # in chunks (a whole 32k-token request of an 8B model's shape is ~9M cells)
        for i in range(0, int(src.shape[0]), step):
            s = slice(i, i + step)
            quantize(layers[s].to(dev), heads[s].to(dev), src[s].to(dev), dst[s].to(dev))

    def _quantize_int4(self, layers, heads, src, dst) -> None:
        """INT4 cells ``dst`` [m] <- full cells ``src`` [m] of (``layers``, ``heads``)."""
        st = self.stack
        assert st.int4_k is not None, "no INT4 pool"
        h, d = self.num_kv_heads, self.head_dim
        # one flat row index per cell (a 3-index gather is several times slower on the CPU)
        full_row = (layers * self.layout.full_slots + src) * h + heads
        row4 = (layers * h + heads) * self.layout.int4_slots + (dst - self.layout.int4_base)
        k = st.full_k.view(-1, d)[full_row]  # [m, D]
        if st.k_channel is not None:
            k = k.float() / st.k_channel.view(-1, d)[layers * h + heads]
        v = st.full_v.view(-1, d)[full_row]
        kc, ks, kz = quantize_int4_ref(k)
        vc, vs, vz = quantize_int4_ref(v)
        st.int4_k.view(-1, d // 2)[row4] = kc
        st.int4_v.view(-1, d // 2)[row4] = vc
        st.int4_scales.view(-1, 4 * (d // GROUP_SIZE))[row4] = torch.cat((ks, kz, vs, vz), dim=1)

    def _quantize_int2_pages(self, layers, heads, src, dst) -> None:
        """INT2 pages of rows ``dst`` [P, 32] <- full cells ``src`` [P, 32] (position order)
        of (``layers``, ``heads``) [P]."""
        st = self.stack
        assert st.int2_k is not None, "no INT2 pool"
        h, d, lay = self.num_kv_heads, self.head_dim, self.layout
        page = (dst[:, 0] - lay.int2_base) // INT2_PAGE
        at = (layers * lay.int2_pages + page) * h + heads  # flat (layer, page, head) rows
        full_row = (layers[:, None] * lay.full_slots + src) * h + heads[:, None]  # [P, 32]
        k = st.full_k.view(-1, d)[full_row][:, :, None, :]  # [P, 32, 1, D]
        v = st.full_v.view(-1, d)[full_row][:, :, None, :]
        kc, ks, kz = quantize_int2_keys_ref(k)
        vc, vs, vz = quantize_int2_values_ref(v)
        for t, x in ((st.int2_k, kc), (st.int2_k_scale, ks), (st.int2_k_zero, kz)):
            t.view(-1, *t.shape[3:])[at] = x[:, 0]
        for t, x in ((st.int2_v, vc), (st.int2_v_scale, vs), (st.int2_v_zero, vz)):
            t.view(-1, *t.shape[3:])[at] = x[:, 0]

    def move_int4(
        self, layers: torch.Tensor, heads: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy INT4 cells (codes and scales, bit for bit) to other INT4 cells of the same
        columns, every layer at once (the write path of :meth:`KVStore.compact_int4`).

        Args:
            layers: int64 ``[m]`` layer of each cell.
            heads: int64 ``[m]`` KV head of each cell.
            src, dst: int64 ``[m]`` INT4 cell ids (unified), ``dst`` disjoint from ``src``.
        """
        if src.numel() == 0:
            return
        st, dev, lay = self.stack, self.device, self.layout
        assert st.int4_k is not None, "no INT4 pool"
        run = (layers.to(dev) * self.num_kv_heads + heads.to(dev)) * lay.int4_slots
        i, j = run + (src.to(dev) - lay.int4_base), run + (dst.to(dev) - lay.int4_base)
        for t in (st.int4_k, st.int4_v, st.int4_scales):  # flat (layer, head, cell) rows
            rows = t.view(-1, *t.shape[3:])
            rows[j] = rows[i]
