"""The GPU's SM clock, power and clock-event reasons while each decode kernel runs back to
back: whether a kernel is slowed by the clocks the GPU gives it, not only by its bytes.

Run on the GPU machine (``nvidia-smi`` on the PATH)::

    python3 benchmarks/decode_clocks.py --shapes '8,32768;32,4096' --slots sorted-live/head

For every shape and impl (SDPA, agentkv's bf16 / INT4 / INT2 / mixed calls as in
``decode_attention.py``, and ``probe``: ``gather_roofline.py``'s read-only probe over
consecutive head-major INT4 rows with the INT4 split's plan, nothing computed) it captures one
CUDA graph of ``--calls`` back-to-back calls (no L2 flush: a decode loop's steady state),
replays it for ``--seconds`` while ``nvidia-smi`` samples the GPU every ``--sample-ms``, and
records the time per call (CUDA events over the replays) with the samples' median SM clock
(MHz), power (W), temperature (C) and the clock-event reasons seen (``sw_power_cap``,
``hw_slowdown``, ...; :data:`REASONS`). Writes ``--out`` (JSON: each row with its samples,
``series``; one file, so a device call's few returned files hold it all) and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_attention import (  # noqa: E402
    DecodeConfig,
    Shape,
    _ours,
    _sdpa,
    _warm_gpu,
    gpu_sampler,
    warm_for_capture,
)

#: nvidia-smi's clock-event reason bits (``clocks_event_reasons.active``)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}
#: the board's limits, recorded once (W, MHz)
LIMITS = "power.limit,enforced.power.limit,power.max_limit,clocks.max.sm,clocks.max.mem"


def reasons(mask: int) -> list[str]:
    """The names of the reason bits set in ``mask``."""
    return [name for bit, name in REASONS.items() if mask & bit]


def parse_sample(line: str) -> dict | None:
    """One sample: SM clock, memory clock, power, temperature, clock-event reasons,
    comma-separated, with or without their units (None if it is not one, e.g. a field the
    driver reports as N/A)."""
    parts = [p.split()[0] if p.split() else "" for p in line.split(",")]
    if len(parts) != 5:
        return None
    try:
        return {
            "sm_mhz": float(parts[0]),
            "mem_mhz": float(parts[1]),
            "power_w": float(parts[2]),
            "temp_c": float(parts[3]),
            "reasons": int(parts[4], 16),
        }
    except ValueError:
        return None


def read_samples(path: Path) -> list[dict]:
    """The samples of a :func:`decode_attention.gpu_sampler` CSV (its header and a line
    that does not parse skipped; the timestamp and utilisation columns dropped)."""
    out = []
    for line in path.read_text().splitlines()[1:]:
        cols = line.split(",")
        if len(cols) == 7:
            s = parse_sample(",".join(cols[1:5] + cols[6:]))
            if s:
                out.append(s)
    return out


def sustained(fn, calls: int, seconds: float, sample_ms: int, csv: Path) -> dict:
    """Replay a graph of ``calls`` x ``fn`` for ``seconds`` under nvidia-smi sampling into
    ``csv``."""
    warm_for_capture(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    smi = gpu_sampler(csv, sample_ms)
    if smi is None:
        raise SystemExit("decode_clocks.py needs nvidia-smi")
    time.sleep(0.2)  # (its first sample)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 0
    t0 = time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            graph.replay()
        replays += 4
        torch.cuda.synchronize()  # (keep the sampled window the graph's)
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    smi.wait(timeout=10)
    samples = read_samples(csv)[2:-1]  # (the edges dropped)
    csv.unlink(missing_ok=True)
    seen = 0
    for s in samples:
        seen |= s["reasons"]
    med = (lambda k: statistics.median(s[k] for s in samples)) if samples else (lambda k: None)
    return {
        "us_per_call": start.elapsed_time(end) * 1e3 / (replays * calls),
        "samples": len(samples),
        "sm_mhz": med("sm_mhz"),
        "sm_mhz_min": min((s["sm_mhz"] for s in samples), default=None),
        "mem_mhz": med("mem_mhz"),
        "power_w": med("power_w"),
        "temp_c": med("temp_c"),
        "reasons": reasons(seen),
        "series": [{**x, "reasons": reasons(x["reasons"])} for x in samples],
    }


def probe(b: int, n: int):
    """The read-only probe over consecutive head-major INT4 rows, the INT4 split's plan."""
    from gather_roofline import planned_split_len, probe_fn

    return probe_fn("int4 head-major", b, n, False, planned_split_len(b, n))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8,32768", help="B,N;B,N;...")
    ap.add_argument("--impls", default="sdpa,bf16,int4,int2,mixed,probe")
    ap.add_argument("--slots", default="sorted-live/head", help="see decode_attention.py")
    ap.add_argument("--calls", type=int, default=50, help="calls per graph")
    ap.add_argument("--seconds", type=float, default=2.0, help="replay time per measurement")
    ap.add_argument("--sample-ms", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("decode_clocks.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_clocks.py needs a CUDA GPU")
    impls = [i for i in args.impls.split(",") if i]
    unknown = set(impls) - {"sdpa", "bf16", "int4", "int2", "mixed", "probe"}
    if unknown:
        raise SystemExit(f"unknown impls {sorted(unknown)}")
    rows = []
    for spec in args.shapes.split(";"):
        b, n = (int(x) for x in spec.split(","))
        s = Shape(b, n, slots=args.slots)
        for impl in impls:
            if impl == "sdpa":
                fn = _sdpa(s)
            elif impl == "probe":
                fn = probe(b, n)
            else:
                fn = _ours(s, impl, False, DecodeConfig())
            _warm_gpu()
            csv = Path(tempfile.gettempdir()) / f"decode_clocks.{os.getpid()}.gpu.csv"
            r = {
                "B": b,
                "N": n,
                "impl": impl,
                **sustained(fn, args.calls, args.seconds, args.sample_ms, csv),
            }
            rows.append(r)
            print(json.dumps(r), flush=True)
            del fn
        del s
        torch.cuda.empty_cache()
    limits = subprocess.run(
        ["nvidia-smi", f"--query-gpu={LIMITS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="minutes"),
        "device": torch.cuda.get_device_name(),
        "limits": dict(
            zip(LIMITS.split(","), (x.strip() for x in limits.split(",")), strict=False)
        ),
        "command": "python3 benchmarks/decode_clocks.py " + " ".join(sys.argv[1:]),
    }
    args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print("limits:", meta["limits"])
    print("\n| B | N | impl | µs per call | vs SDPA | SM MHz (min) | power W | temp C | reasons |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        base = next(
            (
                x["us_per_call"]
                for x in rows
                if (x["B"], x["N"], x["impl"]) == (r["B"], r["N"], "sdpa")
            ),
            None,
        )
        ratio = f"{base / r['us_per_call']:.2f}x" if base else ""
        f = {
            k: "n/a" if r[k] is None else f"{r[k]:.0f}"
            for k in ("sm_mhz", "sm_mhz_min", "power_w", "temp_c")
        }
        print(
            f"| {r['B']} | {r['N']} | {r['impl']} | {r['us_per_call']:.1f} | {ratio} | "
            f"{f['sm_mhz']} ({f['sm_mhz_min']}) | {f['power_w']} | {f['temp_c']} | "
            f"{', '.join(r['reasons']) or '-'} |"
        )


if __name__ == "__main__":
    main()
