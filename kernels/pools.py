"""Mixed-precision KV pool layout for one attention layer: bf16/fp16, INT4 and INT2 pools.

One address space of *unified slot ids* covers the three pools of a layer::

    [0, int4_base)                      full-precision pool (bf16 / fp16) token slots
    [int4_base, int2_base)              INT4 pool token slots        (int4_base = full.num_slots)
    [int2_base, int2_base + 32 * P2)    INT2 pool: page * 32 + row   (int2_base = int4_base + S4)

so the precision of a slot is one comparison against the bases. Slot ``DEAD`` (0 by
convention, a slot of the full pool) is the eviction sentinel: slot maps point evicted
positions at it and every kernel masks it *by id*; it is never read.

Quantization is asymmetric with groups of ``GROUP_SIZE`` = 32 and dequantizes as
``x = code * scale + zero`` (``zero`` is the group minimum, stored as fp16):

* INT4 keys and values: per token, groups of 32 channels. Codes 0..15, two per byte:
  byte ``j`` of a row holds channel ``2j`` in its low nibble and ``2j+1`` in its high nibble.
* INT2 keys: per channel over a page of ``INT2_PAGE`` = 32 tokens (one scale / zero per
  page, head and channel). INT2 values: per token, groups of 32 channels. Codes 0..3, four
  per byte, planar: byte ``j`` of a D-channel row holds channels ``j, j + D/4, j + D/2,
  j + 3D/4`` at bits 0-1, 2-3, 4-5, 6-7 (each bit pair unpacks to a contiguous block).

All tensors of a pool live on one device; this module holds no kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEAD: int = 0
"""Default id of the dead slot (slot 0 of the full-precision pool), masked by id."""

GROUP_SIZE: int = 32
"""Channels per quantization group (INT4 keys/values, INT2 values)."""

INT2_PAGE: int = 32
"""Tokens per INT2 page (INT2 keys share one scale / zero per channel over a page)."""

SCALE_DTYPE = torch.float16
"""dtype of every scale and zero tensor."""


def row_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive rows (the last dim) of ``t`` when every row is
    contiguous and the rows are evenly spaced in order (a contiguous tensor, or a view of
    one field of an interleaved buffer); else None, also where rows overlap (an expanded
    view: a write through it would collide)."""
    stride, shape = t.stride(), t.shape  # (read once: every call on a decode step's path)
    if stride[-1] != 1:
        return None
    ss = stride[-2] if len(stride) > 1 else shape[-1]
    if ss < shape[-1] and t.numel() > shape[-1]:
        return None
    expect = ss
    for i in range(len(stride) - 2, -1, -1):
        if shape[i] > 1 and stride[i] != expect:
            return None
        expect *= shape[i]
    return ss


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless ``head_dim`` suits the quantized pools (a power of two and a
    multiple of 32)."""
    if head_dim % GROUP_SIZE or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two and a multiple of 32, got {head_dim}")


@dataclass
class FullPool:
    """Full-precision token pool.

    k, v: [num_slots, Hkv, D] bf16 or fp16 (fp32 on the torch path, e.g. a CPU engine).
    Slot ``DEAD`` (0) is reserved and never read.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]


@dataclass(frozen=True)
class Int4RowMap:
    """Where an :class:`Int4Pool`'s (slot, head) rows lie: ``slot * slot_rows + head *
    head_rows`` is the row of the code tensors (rows of ``D / 2`` bytes) and of the scale
    tensors (rows ``scale_stride`` fp16 values apart). Slot-major pools have ``(Hkv, 1)``,
    head-major ones ``(1, num_slots)``; 0 for a dim of size 1."""

    slot_rows: int
    head_rows: int
    scale_stride: int
    #: each row's four scale vectors side by side, ``[ks | kz | vs | vz]`` (one buffer)
    interleaved: bool = False


@dataclass
class Int4Pool:
    """INT4 token pool, keys and values quantized per token in groups of 32 channels.

    k, v: [num_slots, Hkv, D // 2] uint8 (two 4-bit codes per byte).
    k_scale, k_zero, v_scale, v_zero: [num_slots, Hkv, D // 32] fp16. :meth:`allocate` makes
        them views of one [num_slots, Hkv, 4, D // 32] buffer, so a row's four scale vectors
        lie side by side (``[ks | kz | vs | vz]``: one 32-byte sector at D=128), which the
        decode kernel reads with one copy per row; four separate contiguous tensors work
        too (the kernels read the row stride, :meth:`scale_row_stride`). The rows may lie
        slot-major (a slot's heads adjacent) or head-major (a head's slots adjacent, one
        run per head): :meth:`row_map` says which, the kernels take either.
    k_channel: optional [Hkv, D] fp32 per-channel key scale (powers of two): keys are stored
        as ``quantize(k / k_channel)`` and read as ``dequantize(...) * k_channel``, so outlier
        key channels do not blow up a token's 32-channel groups. None = 1.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_channel: torch.Tensor | None = None
    # (row_map's last answer and the six tensors it was read from: its checks cost ~4 µs
    # of host time on every decode, gather and write call, session 27, CPU)
    _rows: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_slots(self) -> int:
        return self.k.shape[0]

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        head_major: bool = False,
    ) -> Int4Pool:
        """Zero-filled pool of ``num_slots`` token slots. ``head_major``: each KV head's rows
        in one run of the buffers (``[Hkv, num_slots, ...]`` storage, the fields its
        ``[num_slots, Hkv, ...]`` views), so consecutive slots of one head are adjacent;
        else the rows of a slot's heads are adjacent (``[num_slots, Hkv, ...]`` storage).
        The kernels read both (:meth:`row_map`)."""
        check_head_dim(head_dim)
        rows = (num_kv_heads, num_slots) if head_major else (num_slots, num_kv_heads)

        def zeros(*inner: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*rows, *inner, dtype=dtype, device=device)

        codes = (head_dim // 2,)
        return cls.from_buffers(
            zeros(*codes, dtype=torch.uint8),
            zeros(*codes, dtype=torch.uint8),
            zeros(4, head_dim // GROUP_SIZE, dtype=SCALE_DTYPE),
            head_major,
        )

    @classmethod
    def from_buffers(
        cls, k: torch.Tensor, v: torch.Tensor, scales: torch.Tensor, head_major: bool
    ) -> Int4Pool:
        """The pool over storage it does not own: codes ``k``, ``v`` ``[.., .., D / 2]`` and
        ``scales`` ``[.., .., 4, D / 32]`` (each row's ``[ks | kz | vs | vz]`` side by side),
        laid ``[Hkv, num_slots, ...]`` when ``head_major`` (the fields are their
        ``[num_slots, Hkv, ...]`` views), else ``[num_slots, Hkv, ...]``."""
        if head_major:
            k, v, scales = k.transpose(0, 1), v.transpose(0, 1), scales.transpose(0, 1)
        return cls(k, v, *scales.unbind(2))

    def row_map(self) -> Int4RowMap:
        """Where each (slot, head) row lies in the pool's buffers (see :class:`Int4RowMap`):
        the code tensors' strides in rows of ``D / 2`` bytes, the four scale tensors' at one
        scale row stride. Raises ValueError for a layout the kernels cannot read: codes
        whose rows are not whole, evenly placed ``D / 2``-byte rows, keys and values (or
        the four scale tensors) with different strides, scales placed unlike the codes,
        rows that overlap. Read once per set of tensors: while the pool holds the same six
        tensor objects (none restrided in place), the answer is remembered."""
        held = self._rows
        if held is not None:  # (unrolled: a generator here cost ~1 µs of every decode call)
            k, v, ks, kz, vs, vz = held[0]
            if (
                k is self.k
                and v is self.v
                and ks is self.k_scale
                and kz is self.k_zero
                and vs is self.v_scale
                and vz is self.v_zero
            ):
                return held[1]
        parts = (self.k, self.v, self.k_scale, self.k_zero, self.v_scale, self.v_zero)
        rows = self._read_row_map()
        self._rows = (parts, rows)
        return rows

    def _read_row_map(self) -> Int4RowMap:
        k, w = self.k, self.k.shape[-1]
        num_slots, heads = k.shape[0], k.shape[1]
        if k.stride() != self.v.stride() or k.stride(-1) != 1:
            raise ValueError(
                f"INT4 k and v need equal strides and contiguous rows, got {k.stride()} and "
                f"{self.v.stride()}"
            )
        if k.stride(0) % w or k.stride(1) % w:
            raise ValueError(
                f"INT4 code rows must be {w}-byte rows of one buffer, got {k.stride()}"
            )
        # (a dim of size 1 has no stride to honour: 0 rows)
        slot_rows = k.stride(0) // w if num_slots > 1 else 0
        head_rows = k.stride(1) // w if heads > 1 else 0
        ss = self.k_scale.stride()
        for t in (self.k_zero, self.v_scale, self.v_zero):
            if t.stride() != ss:
                raise ValueError(
                    f"INT4 scale tensors need equal strides, got {t.stride()} next to k_scale's {ss}"
                )
        ng = self.k_scale.shape[-1]
        stride = ss[0] // slot_rows if slot_rows else ss[1] // head_rows if head_rows else ng
        if (
            ss[-1] != 1
            or stride < ng
            or (slot_rows and ss[0] != slot_rows * stride)
            or (head_rows and ss[1] != head_rows * stride)
        ):
            raise ValueError(
                f"INT4 scale rows must be placed as the code rows (strides {ss} vs codes "
                f"{k.stride()})"
            )
        expanded = (num_slots > 1 and not slot_rows) or (heads > 1 and not head_rows)
        apart = slot_rows >= heads * head_rows or head_rows >= num_slots * slot_rows
        if expanded or not apart:
            raise ValueError(f"INT4 pool rows overlap (strides {k.stride()})")
        base = self.k_scale.data_ptr()
        parts = (self.k_zero, self.v_scale, self.v_zero)
        interleaved = stride == 4 * ng and all(
            t.data_ptr() == base + 2 * i * ng for i, t in enumerate(parts, 1)
        )
        return Int4RowMap(slot_rows, head_rows, stride, interleaved)

    @property
    def head_major(self) -> bool:
        """True when each KV head's slots are adjacent rows (:meth:`allocate`'s
        ``head_major``; a pool of one head or one slot is not)."""
        rows = self.row_map()
        return rows.head_rows > rows.slot_rows > 0

    def scale_row_stride(self) -> int:
        """Elements between one (slot, head) row's scales and the next's in the row order
        of :meth:`row_map`, shared by the four scale / zero tensors (D / 32 for separate
        contiguous tensors, 4 D / 32 for the interleaved buffer of :meth:`allocate`).
        Raises ValueError where :meth:`row_map` does."""
        return self.row_map().scale_stride

    @property
    def scales_interleaved(self) -> bool:
        """True when each row's scales and zeros lie side by side, ``[ks | kz | vs | vz]``
        (False for a layout :meth:`row_map` refuses)."""
        try:
            return self.row_map().interleaved
        except ValueError:
            return False


@dataclass
class Int2Pool:
    """INT2 paged pool; a page holds ``INT2_PAGE`` = 32 tokens.

    k, v: [num_pages, Hkv, 32, D // 4] uint8 (four 2-bit codes per byte).
    k_scale, k_zero: [num_pages, Hkv, D] fp16 (keys: per channel over the page).
    v_scale, v_zero: [num_pages, Hkv, 32, D // 32] fp16 (values: per token, 32-channel groups).
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @classmethod
    def allocate(
        cls, num_pages: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu"
    ) -> Int2Pool:
        """Zero-filled pool of ``num_pages`` pages of 32 tokens."""
        check_head_dim(head_dim)
        ng = head_dim // GROUP_SIZE
        shape = (num_pages, num_kv_heads, INT2_PAGE, head_dim // 4)

        def u8() -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.uint8, device=device)

        def ksc() -> torch.Tensor:
            return torch.zeros(num_pages, num_kv_heads, head_dim, dtype=SCALE_DTYPE, device=device)

        def vsc() -> torch.Tensor:
            return torch.zeros(
                num_pages, num_kv_heads, INT2_PAGE, ng, dtype=SCALE_DTYPE, device=device
            )

        return cls(u8(), u8(), ksc(), ksc(), vsc(), vsc())


class LayoutKey:
    """:meth:`KVPools.layout_key`'s answer: the tuple ``parts`` with its hash computed once
    (a decode call's plan is looked up under it on every call; hashing the nested tuple cost
    ~1 µs each time)."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, LayoutKey) and self.parts == other.parts)

    def __repr__(self) -> str:
        return f"LayoutKey({self.parts!r})"


@dataclass
class KVPools:
    """The three pools of one layer and their unified slot-id address space.

    ``int4`` / ``int2`` may be None when a layer has no such pool (no kernel is launched
    for it). ``full`` always exists: it holds the DEAD slot.
    """

    full: FullPool
    int4: Int4Pool | None = None
    int2: Int2Pool | None = None
    # (layout_key's last answer and the tensors it was read from)
    _layout: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.int4 is not None or self.int2 is not None:
            check_head_dim(self.head_dim)
        if self.full.k.shape != self.full.v.shape:
            raise ValueError("full.k and full.v must have the same shape")
        if self.full.k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"full pool dtype must be bf16, fp16 or fp32, got {self.full.k.dtype}")
        for name, pool in (("int4", self.int4), ("int2", self.int2)):
            if pool is None:
                continue
            if pool.k.shape[1] != self.num_kv_heads:
                raise ValueError(f"{name} pool has {pool.k.shape[1]} kv heads")
            if pool.k.dtype != torch.uint8 or pool.k_scale.dtype != SCALE_DTYPE:
                raise ValueError(f"{name} pool must be uint8 codes with fp16 scales")
        if self.int4 is not None:
            self.int4.row_map()  # a layout no kernel can read fails here (ValueError)

    def layout_key(self) -> LayoutKey:
        """A hashable summary of how the pools' tensors lie: per tensor (full K and V, the
        INT4 pool's codes, scales, zeros and per-channel key scale, the INT2 pool's six),
        its shape, strides, dtype, device and address modulo 16 bytes (None for an absent
        one). Two pools with equal keys take the same kernel launches (different tensors,
        e.g. two layers'). Remembered while the pools hold the same tensor objects (as
        :meth:`Int4Pool.row_map`: a tensor restrided or re-pointed in place is not seen;
        a tensor replaced stays referenced until the next call, so free a pool by
        replacing the :class:`KVPools`, not its tensors)."""
        tensors = self._tensors()
        held = self._layout
        if held is not None and len(held[0]) == len(tensors):
            for a, b in zip(held[0], tensors, strict=True):
                if a is not b:
                    break
            else:
                return held[1]
        key = LayoutKey(
            tuple(
                None
                if t is None
                else (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                for t in tensors
            )
        )
        self._layout = (tensors, key)
        return key

    def _tensors(self) -> tuple:
        f, p4, p2 = self.full, self.int4, self.int2
        ts = (f.k, f.v)
        if p4 is not None:
            ts += (p4.k, p4.v, p4.k_scale, p4.k_zero, p4.v_scale, p4.v_zero, p4.k_channel)
        if p2 is not None:
            ts += (None, p2.k, p2.v, p2.k_scale, p2.k_zero, p2.v_scale, p2.v_zero)
        return ts

    @property
    def num_kv_heads(self) -> int:
        return self.full.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.full.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.full.k.dtype

    @property
    def device(self) -> torch.device:
        return self.full.k.device

    @property
    def int4_base(self) -> int:
        """First unified slot id of the INT4 pool (= number of full-precision slots)."""
        return self.full.num_slots

    @property
    def int2_base(self) -> int:
        """First unified slot id of the INT2 pool."""
        return self.int4_base + (self.int4.num_slots if self.int4 is not None else 0)

    @property
    def num_unified_slots(self) -> int:
        return self.int2_base + (INT2_PAGE * self.int2.num_pages if self.int2 is not None else 0)

    def int4_slot_ids(self, local_slots: torch.Tensor) -> torch.Tensor:
        """Unified ids of INT4 pool slots ``local_slots`` (any int shape)."""
        return local_slots + self.int4_base

    def int2_slot_ids(self, pages: torch.Tensor) -> torch.Tensor:
        """Unified ids of every row of INT2 ``pages`` [P] -> [P, 32] (rows in order)."""
        rows = torch.arange(INT2_PAGE, device=pages.device, dtype=pages.dtype)
        return self.int2_base + pages[:, None] * INT2_PAGE + rows[None, :]

    @classmethod
    def allocate(
        cls,
        num_full_slots: int,
        num_int4_slots: int,
        num_int2_pages: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        int4_head_major: bool = False,
    ) -> KVPools:
        """Zero-filled pools; a pool with zero capacity is None. Slot 0 of ``full`` is DEAD.
        ``int4_head_major``: the INT4 pool's rows head-major (:meth:`Int4Pool.allocate`)."""
        full = FullPool(
            torch.zeros(num_full_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
            torch.zeros(num_full_slots, num_kv_heads, head_dim, dtype=dtype, device=device),
        )
        int4 = (
            Int4Pool.allocate(num_int4_slots, num_kv_heads, head_dim, device, int4_head_major)
            if num_int4_slots
            else None
        )
        int2 = (
            Int2Pool.allocate(num_int2_pages, num_kv_heads, head_dim, device)
            if num_int2_pages
            else None
        )
        return cls(full, int4, int2)

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one token (K and V, all kv heads) occupies in each pool, scales included."""
        h, d = self.num_kv_heads, self.head_dim
        ng = d // GROUP_SIZE
        full = 2 * h * d * self.full.k.element_size()
        int4 = 2 * h * (d // 2 + 2 * ng * 2)
        int2 = h * (d // 4 + 2 * d * 2 / INT2_PAGE) + h * (d // 4 + 2 * ng * 2)
        return {"full": float(full), "int4": float(int4), "int2": float(int2)}
