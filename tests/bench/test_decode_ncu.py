"""benchmarks/decode_ncu.py's stall summary of ncu's source page (no GPU, no ncu: a CSV in
the page's shape)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from decode_ncu import KERNELS, top_stalls  # noqa: E402

HEAD = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
    '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"'
)


def test_top_stalls_ranks_instructions_and_reasons() -> None:
    csv_text = "\n".join(
        [
            '"Kernel Name","int4_split_gluon_kernel",',
            HEAD,
            '"0x7f0000000100","SHFL.IDX PT, R6, R7, R114, 0x1f","60","65,536","58","2","50"',
            '"0x7f0000000110","HMMA.16816.F32 R72, R28, R82, R72","30","65,536","0","30","0"',
            '"0x7f0000000120","EXIT","10","3,008","5","5","5"',
        ]
    )
    text = top_stalls(csv_text, n=2)
    lines = text.splitlines()
    assert lines[0] == "100 samples over 3 SASS instructions"
    # reasons by share of all samples, the "Not Issued" columns left out
    assert lines[1].split() == ["long_sb", "63.0%"] and lines[2].split() == ["wait", "37.0%"]
    assert "Not" not in text
    top = lines[4:]
    assert len(top) == 2 and "SHFL.IDX" in top[0] and "HMMA" in top[1]
    assert top[0].split()[0] == "60.0%" and "x65536" in top[0] and "long_sb=58.0" in top[0]


def test_top_stalls_without_source_rows() -> None:
    assert top_stalls("==ERROR== no kernels were profiled") == "no source rows\n"


def test_both_gluon_splits_are_profiled() -> None:
    assert {"int2_split_gluon_kernel", "int4_split_gluon_kernel"} <= set(KERNELS)
