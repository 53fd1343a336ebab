"""benchmarks/decode_table.py renders a decode_attention.py run; ``--kernel`` takes every
time, speed-up and bandwidth from the rows' CUDA-graph ``kernel_us`` instead of do_bench's
``time_us`` (which carries the host floor)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from decode_table import kernel_times, render  # noqa: E402


def _row(impl: str, time_us: float, kernel_us: float | None, nbytes: float) -> dict:
    row = {
        "impl": impl,
        "B": 8,
        "N": 32768,
        "dead_fraction": 0.0,
        "time_us": time_us,
        "bytes": nbytes,
        "bandwidth_TBps": nbytes / time_us / 1e6,
        "speedup_vs_sdpa": None,
    }
    if kernel_us is not None:
        row["kernel_us"] = kernel_us
    return row


def _doc() -> dict:
    return {
        "gpu": "test GPU",
        "date": "2026-11-28",
        "command": "python benchmarks/decode_attention.py",
        "shape": {"Hq": 32, "Hkv": 8, "D": 128},
        "timing": "do_bench",
        "results": [
            _row("sdpa_bf16", 300.0, 250.0, 1.0e9),
            _row("int4", 400.0, 125.0, 0.3e9),  # host-bound under do_bench
            _row("int2", 200.0, None, 0.2e9),  # no graph timing: dropped
        ],
    }


def test_kernel_times_replace_the_do_bench_figures() -> None:
    doc = _doc()
    res = {r["impl"]: r for r in kernel_times(doc)["results"]}
    assert set(res) == {"sdpa_bf16", "int4"}
    assert res["int4"]["time_us"] == 125.0
    assert res["int4"]["speedup_vs_sdpa"] == 2.0
    assert abs(res["int4"]["bandwidth_TBps"] - 0.3e9 / 125.0 / 1e6) < 1e-12
    assert doc["results"][1]["time_us"] == 400.0  # the input is left as it was


def test_rendered_table_shows_the_chosen_timer() -> None:
    kernel = render(kernel_times(_doc()))
    assert "| 8 | 32k | 250.0 | — | — | 125.0 (2.00×) | — | — |" in kernel
    assert "kernel_us, the kernels alone" in kernel
    plain = render(_doc())
    assert "| 8 | 32k | 300.0 |" in plain


def test_host_table_keeps_do_bench_beside_the_kernel_time() -> None:
    """With ``--kernel`` the main tables show kernel_us, but the host table's do_bench
    column still shows do_bench's own time (it is there to be compared with the kernel's)."""
    doc = _doc()
    doc["results"][1]["host_us"] = 90.0
    kernel = render(kernel_times(doc))
    assert "| 8 | 32k | int4 | 400.0 | 125.0 | 90.0 |" in kernel
    assert "| 8 | 32k | int4 | 400.0 | 125.0 | 90.0 |" in render(doc)
