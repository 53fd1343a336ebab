"""How fast the decode kernel's scattered row reads can go at all: a read-only probe.

The quantized decode kernels read, per (position, KV head), a few short rows at a slot
taken from the slot map: INT4 a 64-byte key row, a 64-byte value row and a 32-byte scale
row from three tensors. This probe reads exactly those rows with the decode kernel's grid
and pipelining (one program per (KV head, split, request), the quantized splits' plan, 1
warp, 32 positions per iteration, ``num_stages`` 3, the slot map read in the loop) and does
nothing with them but xor them together, so its time is what the reads alone cost. Layouts (``useful`` bytes per
(position, head) in brackets):

- ``int4 pool``: the pool's three tensors (160 B);
- ``int4 kv fused``: key and value codes in one 128-byte row, scales apart (160 B);
- ``int4 row fused``: codes and scales in one 160-byte row (160 B);
- ``bf16 pool``: the bf16 pool's two 256-byte rows (512 B), the bf16 path's reads;
- ``int4 head-major``: the pool's three tensors with each KV head's rows adjacent (row
  ``head * tokens + slot``, ``Int4Pool.allocate(head_major=True)``, the store's layout) (160 B);
  ``int4 kv fused head-major`` / ``int4 row fused head-major``: the two fused layouts so;
- ``int2 pages``: a 32-byte key and a 32-byte value code row and 32 bytes of scales per
  (position, head), a page's 32 rows contiguous per head (96 B);

each with the positions on scattered (random) or consecutive slots, and with the program
shape as a sweep (``--warps``, ``--block``: warps per program and positions per iteration;
the kernels' own shape is 1 warp and 32 positions). Useful TB/s = (rows'
bytes + slot map) / time, the same count as ``decode_attention.py``'s roofline. Run on the
GPU machine::

    python3 benchmarks/gather_roofline.py --out $OUT/gather_roofline.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention import _kernel_us, _warm_gpu  # noqa: E402

from agentkv.kernels import DecodeConfig  # noqa: E402
from agentkv.kernels.decode_attention import plan_wave_splits  # noqa: E402

HEADS = 8


@triton.jit
def _rows_xor(ptr, row, live, STRIDE: tl.constexpr, OFF: tl.constexpr, W: tl.constexpr):
    """xor over the W int32 words at OFF of each live row ([BN] -> [BN, W] -> [BN])."""
    x = tl.load(ptr + row[:, None] * STRIDE + OFF + tl.arange(0, W)[None, :], mask=live[:, None])
    return tl.reduce(x, 1, _xor)


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _gather_probe(
    slot_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    out_ptr,
    n_pos,
    Hkv,
    rows_per_head,
    split_len,
    BN: tl.constexpr,
    A_STRIDE: tl.constexpr,
    A_W: tl.constexpr,
    B_STRIDE: tl.constexpr,
    B_OFF: tl.constexpr,
    B_W: tl.constexpr,
    C_STRIDE: tl.constexpr,
    C_OFF: tl.constexpr,
    C_W: tl.constexpr,
    PAGED: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    """Read streams a, b, c (int32 words; W = 0: not read) of each position's row (PAGED:
    rows ``(page * Hkv + head) * 32 + slot % 32``, a 32-slot page's rows contiguous per head,
    as in the INT2 pool; HEAD_MAJOR: ``head * rows_per_head + slot``; else
    ``slot * Hkv + head``)."""
    h = tl.program_id(0)
    s = tl.program_id(1)
    r = tl.program_id(2)
    start = s * split_len
    end = tl.minimum(start + split_len, n_pos)
    acc = tl.zeros([BN], tl.int32)
    arn = tl.arange(0, BN)
    for n in range(start, end, BN):
        offs = n + arn
        inb = offs < end
        slot = tl.load(slot_ptr + r * n_pos + offs, mask=inb, other=0)
        if PAGED:
            row = (slot // 32 * Hkv + h) * 32 + slot % 32
        elif HEAD_MAJOR:
            row = h * rows_per_head + slot
        else:
            row = slot * Hkv + h
        acc ^= _rows_xor(a_ptr, row, inb, A_STRIDE, 0, A_W)
        if B_W > 0:
            acc ^= _rows_xor(b_ptr, row, inb, B_STRIDE, B_OFF, B_W)
        if C_W > 0:
            acc ^= _rows_xor(c_ptr, row, inb, C_STRIDE, C_OFF, C_W)
    tl.store(out_ptr + (r * tl.num_programs(1) + s) * Hkv + h, tl.reduce(acc, 0, _xor))


#: layout -> streams (stride words, offset words, width words) of a, b, c; "shared" names
#: the streams that are one tensor (fused rows); "paged": rows laid out as INT2 pages
LAYOUTS = {
    "int4 pool": dict(a=(16, 0, 16), b=(16, 0, 16), c=(8, 0, 8), shared=""),
    "int4 kv fused": dict(a=(32, 0, 32), b=(32, 0, 0), c=(8, 0, 8), shared=""),
    "int4 row fused": dict(a=(40, 0, 32), b=(40, 0, 0), c=(40, 32, 8), shared="ac"),
    "int4 head-major": dict(a=(16, 0, 16), b=(16, 0, 16), c=(8, 0, 8), shared="", heads=True),
    "int4 kv fused head-major": dict(
        a=(32, 0, 32), b=(32, 0, 0), c=(8, 0, 8), shared="", heads=True
    ),
    "int4 row fused head-major": dict(
        a=(40, 0, 32), b=(40, 0, 0), c=(40, 32, 8), shared="ac", heads=True
    ),
    "bf16 pool": dict(a=(64, 0, 64), b=(64, 0, 64), c=(1, 0, 0), shared=""),
    # INT2: 32-byte key and value code rows and 32 bytes of scales per (position, head)
    # (value scales / zeros per row, the page's key scales / zeros spread over its rows)
    "int2 pages": dict(a=(8, 0, 8), b=(8, 0, 8), c=(8, 0, 8), shared="", paged=True),
}


def planned_split_len(batch: int, n: int) -> int:
    """Positions per program as the default config plans the scale-folded INT4 / INT2
    splits on this GPU (``plan_wave_splits``: whole waves of 8 resident one-warp programs
    per SM, capped; as INT2 and mixed launches plan them: an INT4-only launch may give a
    program several chunks of the cap, ``DecodeConfig.chunked_splits``)."""
    cfg = DecodeConfig()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = cfg.folded_split_cap(n)
    (split,) = plan_wave_splits(
        batch * HEADS, (n,), (cap,), sms * 8, cfg.min_split_len, cfg.program_overhead_len
    )
    return split


@dataclass
class ProbeInputs:
    """One probe's rows: int32 streams a, b, c (``[rows * stride]``; c may be a) and the
    slot map ``[batch, n]`` int32."""

    layout: str
    slot_map: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    @property
    def useful_bytes(self) -> int:
        """Bytes a kernel must read: every position's row words and its slot-map entry,
        once per KV head."""
        spec = LAYOUTS[self.layout]
        rows = self.slot_map.numel() * HEADS
        return sum(spec[k][2] for k in "abc") * 4 * rows + self.slot_map.numel() * 4 * HEADS


def probe_inputs(
    layout: str, batch: int, n: int, scatter: bool, device: torch.device | str = "cuda"
) -> ProbeInputs:
    """Random rows of ``layout`` for ``batch`` requests of ``n`` positions (8 KV heads); n
    a multiple of 32 for the paged (INT2) layout."""
    dev = torch.device(device)
    spec = LAYOUTS[layout]
    tokens = batch * n
    g = torch.Generator(device=dev).manual_seed(0)
    rows = tokens * HEADS

    def stream(key: str) -> torch.Tensor:
        stride, _, w = spec[key]
        size = (rows * stride if w else 1,)
        return torch.randint(-(2**31), 2**31 - 1, size, device=dev, generator=g, dtype=torch.int32)

    a = stream("a")
    b = stream("b")
    c = a if "c" in spec["shared"] else stream("c")
    paged = spec.get("paged", False)
    # scattered: a random order of the slots (INT2: of the 32-slot pages, a page's positions
    # on its consecutive slots); else every request on consecutive slots
    units = tokens // 32 if paged else tokens
    order = (
        torch.randperm(units, device=dev, generator=g)
        if scatter
        else torch.arange(units, device=dev)
    )
    slots = (order[:, None] * 32 + torch.arange(32, device=dev)).flatten() if paged else order
    return ProbeInputs(layout, slots.int().view(batch, n), a, b, c)


def probe_launch(
    x: ProbeInputs,
    split_len: int,
    stages: int = 3,
    out: torch.Tensor | None = None,
    warps: int = 1,
    block: int = 32,
) -> torch.Tensor:
    """One launch of the probe: ``[batch * splits * 8]`` int32 (into ``out`` if given), the
    xor of every row word a (request, split, KV head) program read; programs of ``warps``
    warps reading ``block`` positions per iteration (a power of two, >= 32)."""
    spec = LAYOUTS[x.layout]
    batch, n = x.slot_map.shape
    splits = triton.cdiv(n, split_len)
    if out is None:
        out = torch.empty(batch * splits * HEADS, device=x.a.device, dtype=torch.int32)
    _gather_probe[(HEADS, splits, batch)](
        x.slot_map,
        x.a,
        x.b,
        x.c,
        out,
        n,
        HEADS,
        batch * n,
        split_len,
        BN=block,
        A_STRIDE=spec["a"][0],
        A_W=spec["a"][2],
        B_STRIDE=spec["b"][0],
        B_OFF=spec["b"][1],
        B_W=spec["b"][2],
        C_STRIDE=spec["c"][0],
        C_OFF=spec["c"][1],
        C_W=spec["c"][2],
        PAGED=spec.get("paged", False),
        HEAD_MAJOR=spec.get("heads", False),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def probe_reference(x: ProbeInputs, split_len: int) -> torch.Tensor:
    """:func:`probe_launch`'s output computed in torch (what the kernel must read)."""
    spec = LAYOUTS[x.layout]
    batch, n = x.slot_map.shape
    splits = triton.cdiv(n, split_len)
    slot = x.slot_map.long()
    heads = torch.arange(HEADS, device=slot.device)
    if spec.get("paged", False):
        row = (slot[..., None] // 32 * HEADS + heads) * 32 + slot[..., None] % 32
    elif spec.get("heads", False):
        row = heads * slot.numel() + slot[..., None]
    else:
        row = slot[..., None] * HEADS + heads  # [batch, n, heads]
    acc = torch.zeros(batch, n, HEADS, dtype=torch.int32, device=slot.device)
    for key, t in (("a", x.a), ("b", x.b), ("c", x.c)):
        stride, off, w = spec[key]
        for i in range(w):
            acc ^= t[row * stride + off + i]
    out = torch.zeros(batch, splits, HEADS, dtype=torch.int32, device=slot.device)
    for p in range(n):
        out[:, p // split_len] ^= acc[:, p]
    return out.flatten()


def probe_fn(
    layout: str,
    batch: int,
    n: int,
    scatter: bool,
    split_len: int,
    stages: int = 3,
    warps: int = 1,
    block: int = 32,
):
    """(fn, useful bytes): one launch of the probe over fresh random rows of ``layout``
    (``batch`` requests of ``n`` positions, 8 KV heads) on the GPU."""
    x = probe_inputs(layout, batch, n, scatter)
    out = torch.empty(batch * triton.cdiv(n, split_len) * HEADS, device="cuda", dtype=torch.int32)
    return (lambda: probe_launch(x, split_len, stages, out, warps, block)), x.useful_bytes


def _probe(layout: str, batch: int, n: int, scatter: bool, split_len: int, *shape: int):
    fn, useful = probe_fn(layout, batch, n, scatter, split_len, *shape)
    us = _kernel_us(fn)
    return us, useful / us / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8,32768;32,4096;1,32768", help="B,N;B,N;...")
    ap.add_argument(
        "--split-len",
        type=int,
        default=0,
        help="positions per program (0: the quantized decode splits' own plan)",
    )
    ap.add_argument("--stages", default="3", help="num_stages values, comma-separated")
    ap.add_argument("--warps", default="1", help="warps per program, comma-separated")
    ap.add_argument("--block", default="32", help="positions per iteration, comma-separated")
    ap.add_argument("--layouts", default=";".join(LAYOUTS), help="names, ';'-separated")
    ap.add_argument("--out", type=Path, default=Path("gather_roofline.json"))
    args = ap.parse_args()
    unknown = [v for v in args.layouts.split(";") if v not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    _warm_gpu(2.0)
    rows = []
    for shape in args.shapes.split(";"):
        batch, n = (int(x) for x in shape.split(","))
        split_len = args.split_len or planned_split_len(batch, n)
        shapes = itertools.product(
            *(map(int, v.split(",")) for v in (args.stages, args.warps, args.block))
        )
        for (stages, warps, block), layout, scatter in itertools.product(
            list(shapes), args.layouts.split(";"), (True, False)
        ):
            us, tbps = _probe(layout, batch, n, scatter, split_len, stages, warps, block)
            row = dict(
                B=batch,
                N=n,
                layout=layout,
                scattered=scatter,
                stages=stages,
                warps=warps,
                block=block,
                split_len=split_len,
                us=round(us, 1),
                useful_tbps=round(tbps, 3),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
