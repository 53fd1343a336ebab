"""benchmarks/decode_clocks.py reads nvidia-smi's samples: the clock-event reason bits by
name, a sample line's fields, and lines it cannot read (a field reported as N/A) skipped,
from the CSV that decode_attention.gpu_sampler writes."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from decode_clocks import parse_sample, read_samples, reasons  # noqa: E402


def test_reason_bits_by_name() -> None:
    assert reasons(0) == []
    assert reasons(0x4) == ["sw_power_cap"]
    assert reasons(0x4 | 0x40 | 0x80) == ["sw_power_cap", "hw_thermal", "hw_power_brake"]


def test_a_sample_line_is_read_with_its_reason_mask() -> None:
    s = parse_sample("1785, 3201, 650.12, 53, 0x0000000000000004")
    assert s == {
        "sm_mhz": 1785.0,
        "mem_mhz": 3201.0,
        "power_w": 650.12,
        "temp_c": 53.0,
        "reasons": 0x4,
    }
    assert reasons(s["reasons"]) == ["sw_power_cap"]


def test_lines_it_cannot_read_are_skipped() -> None:
    assert parse_sample("1980, 3201, [N/A], 48, 0x0000000000000000") is None
    assert parse_sample("clocks.sm [MHz], clocks.mem [MHz]") is None
    assert parse_sample("") is None


def test_the_samplers_csv_is_read_with_units_and_unreadable_lines_skipped(tmp_path) -> None:
    csv = tmp_path / "s.gpu.csv"
    csv.write_text(
        "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
        "temperature.gpu, utilization.gpu [%], clocks_event_reasons.active\n"
        "2026/11/29 20:50:01.123, 1785 MHz, 3201 MHz, 650.12 W, 53, 100 %, 0x0000000000000004\n"
        "2026/11/29 20:50:01.173, 1980 MHz, 3201 MHz, [N/A], 53, 100 %, 0x0000000000000000\n"
        "2026/11/29 20:50:01.223, 1980 MHz, 3201 MHz, 563.00 W, 52, 99 %, 0x0000000000000000\n"
    )
    got = read_samples(csv)
    assert [(s["sm_mhz"], s["power_w"], s["reasons"]) for s in got] == [
        (1785.0, 650.12, 0x4),
        (1980.0, 563.0, 0x0),
    ]
