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
"""

from __future__ import annotations

import torch

from agentkv.cache.precision import Precision
from agentkv.cache.slot_allocator import PoolLayout
from agentkv.kernels import (
    GROUP_SIZE,
    INT2_PAGE,
    KVPools,
    dequant_gather,
    quantize_int2_keys_ref,
    quantize_int2_values_ref,
    quantize_int4_ref,
)
from agentkv.kernels.backend import Backend


class KVPool:
    """K/V pools of every layer.

    Each layer's INT4 pool is head-major (``Int4Pool.allocate(head_major=True)``): a (layer,
    KV head) column's cells are consecutive rows of its own run, and the allocator hands a
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
        self.layers = [
            KVPools.allocate(
                layout.full_slots,
                layout.int4_slots,
                layout.int2_pages,
                num_kv_heads,
                head_dim,
                dtype,
                self.device,
                int4_head_major=True,
            )
            for _ in range(num_layers)
        ]
        self._heads = torch.arange(num_kv_heads, device=self.device)[None, :]  # write index

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
        h, n = cells.shape
        if tuple(k.shape) != (n, h, self.head_dim) or k.shape != v.shape:
            raise ValueError(
                f"k and v must be [{n}, {h}, {self.head_dim}], got {list(k.shape)} / {list(v.shape)}"
            )
        full = self.layers[layer].full
        idx = cells.to(self.device, torch.int64).t()
        full.k[idx, self._heads] = k.to(self.device, self.dtype)
        full.v[idx, self._heads] = v.to(self.device, self.dtype)

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
        a = key_absmax.float().to(self.device).clamp_min(1e-6)
        p4.k_channel = torch.exp2(torch.floor(torch.log2(a))).contiguous()

    def demote(
        self,
        layer: int,
        heads: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
        precision: Precision,
    ) -> None:
        """Quantize full-precision cells into quantized ones (the write path of a demotion).

        Args:
            layer: layer index.
            heads: int64 ``[m]`` KV head of each cell (INT2: of each page).
            src: int64 full-precision cell ids, ``[m]`` (INT4) or ``[m, 32]`` (INT2: the 32
                rows of one page, position order).
            dst: int64 ``[m]`` INT4 cell ids, or ``[m, 32]`` INT2 row ids of whole pages.
            precision: ``INT4`` or ``INT2``.
        """
        if src.numel() == 0:
            return
        pools = self.layers[layer]
        dev = self.device
        heads, src, dst = heads.to(dev), src.to(dev), dst.to(dev)
        if precision == Precision.INT4:
            p4 = pools.int4
            assert p4 is not None, "no INT4 pool"
            i = dst - pools.int4_base
            k = pools.full.k[src, heads]
            if p4.k_channel is not None:
                k = k.float() / p4.k_channel[heads]
            v = pools.full.v[src, heads]
            p4.k[i, heads], p4.k_scale[i, heads], p4.k_zero[i, heads] = quantize_int4_ref(k)
            p4.v[i, heads], p4.v_scale[i, heads], p4.v_zero[i, heads] = quantize_int4_ref(v)
        elif precision == Precision.INT2:
            p2 = pools.int2
            assert p2 is not None, "no INT2 pool"
            page = (dst[:, 0] - pools.int2_base) // INT2_PAGE
            hh = heads[:, None]
            k = pools.full.k[src, hh][:, :, None, :]  # [P, 32, 1, D]
            v = pools.full.v[src, hh][:, :, None, :]
            kc, ks, kz = quantize_int2_keys_ref(k)
            vc, vs, vz = quantize_int2_values_ref(v)
            p2.k[page, heads], p2.k_scale[page, heads], p2.k_zero[page, heads] = (
                kc[:, 0],
                ks[:, 0],
                kz[:, 0],
            )
            p2.v[page, heads], p2.v_scale[page, heads], p2.v_zero[page, heads] = (
                vc[:, 0],
                vs[:, 0],
                vz[:, 0],
            )
        else:
            raise ValueError(f"cannot demote to {precision!r}")

    def move_int4(
        self, layer: int, heads: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy INT4 cells of ``layer`` (codes and scales, bit for bit) to other INT4 cells
        of the same columns (the write path of :meth:`KVStore.compact_int4`).

        Args:
            layer: layer index.
            heads: int64 ``[m]`` KV head of each cell.
            src, dst: int64 ``[m]`` INT4 cell ids (unified), ``dst`` disjoint from ``src``.
        """
        if src.numel() == 0:
            return
        pools = self.layers[layer]
        p4 = pools.int4
        assert p4 is not None, "no INT4 pool"
        dev = self.device
        heads = heads.to(dev)
        i, j = src.to(dev) - pools.int4_base, dst.to(dev) - pools.int4_base
        for t in (p4.k, p4.v, p4.k_scale, p4.k_zero, p4.v_scale, p4.v_zero):
            t[j, heads] = t[i, heads]
