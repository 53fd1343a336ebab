"""benchmarks/gather_roofline.py's read-only probe reads exactly the rows its layouts say
(every row word of every live position, once per KV head), against its torch reference
(the Triton interpreter on a CPU, the compiled kernel on a GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gather_roofline import (  # noqa: E402
    LAYOUTS,
    probe_inputs,
    probe_launch,
    probe_reference,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("scatter", [True, False], ids=["scattered", "consecutive"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_probe_reads_exactly_its_rows(layout: str, scatter: bool) -> None:
    """96 positions in splits of 64: a full split and a split of one 32-position block."""
    x = probe_inputs(layout, batch=2, n=96, scatter=scatter, device=DEVICE)
    out = probe_launch(x, split_len=64)
    ref = probe_reference(x, split_len=64)
    assert out.shape == (2 * 2 * 8,)
    assert torch.equal(out.cpu(), ref.cpu())
    assert x.useful_bytes == 2 * 96 * 8 * (4 * sum(LAYOUTS[layout][k][2] for k in "abc") + 4)


def test_reference_sees_every_row_word() -> None:
    """Flipping one word of one position's row changes exactly its program's output."""
    x = probe_inputs("int4 pool", batch=1, n=64, scatter=True, device=DEVICE)
    before = probe_reference(x, split_len=32)
    slot, head, word = int(x.slot_map[0, 40]), 3, 5
    x.b[(slot * 8 + head) * 16 + word] ^= 1
    after = probe_reference(x, split_len=32)
    changed = (before != after).nonzero().flatten().tolist()
    assert changed == [1 * 8 + head]  # split 1 (positions 32..63), KV head 3
    assert torch.equal(probe_launch(x, split_len=32).cpu(), after.cpu())


@pytest.mark.parametrize(("warps", "block"), [(2, 64), (4, 128)])
def test_program_shapes_read_the_same_rows(warps: int, block: int) -> None:
    """Programs of several warps reading 64 or 128 positions per iteration (longer than the
    split: the rest masked) give the reference's xor."""
    x = probe_inputs("int4 head-major", batch=2, n=96, scatter=True, device=DEVICE)
    out = probe_launch(x, split_len=64, warps=warps, block=block)
    assert torch.equal(out.cpu(), probe_reference(x, split_len=64).cpu())


def test_head_major_rows_are_a_heads_rows_adjacent() -> None:
    """In the head-major layout slot s of KV head h is row ``h * tokens + s``: flipping a word
    there changes only that head's program."""
    x = probe_inputs("int4 head-major", batch=1, n=64, scatter=False, device=DEVICE)
    before = probe_reference(x, split_len=64)
    x.a[(5 * 64 + int(x.slot_map[0, 7])) * 16 + 2] ^= 1 << 4
    after = probe_reference(x, split_len=64)
    assert (before != after).nonzero().flatten().tolist() == [5]
    assert torch.equal(probe_launch(x, split_len=64).cpu(), after.cpu())
