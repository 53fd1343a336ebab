"""Render docs/benchmarks/decode_attention.json as the markdown table of
section 3 of docs/benchmarks.md (no GPU needed).

    python benchmarks/decode_table.py [--json docs/benchmarks/decode_attention.json] [--kernel]

``--kernel``: times, speed-ups and bandwidths from each row's ``kernel_us`` (the kernels
alone, from a CUDA graph) instead of ``time_us`` (do_bench, which includes any host floor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

IMPLS = ("sdpa_bf16", "sglang_bf16", "bf16", "int4", "int2", "mixed")
TARGETS = {"int4": 2.5, "int2": 4.0}


def _key(r: dict) -> tuple:
    return (r["B"], r["N"], r["impl"], r["dead_fraction"], r.get("dead_pattern") or "")


def render(doc: dict) -> str:
    rows = {_key(r): r for r in doc["results"]}
    shapes = sorted({(r["B"], r["N"]) for r in doc["results"]})
    out = [
        f"GPU: {doc['gpu']} · date: {doc['date']} · torch {doc.get('torch')} · "
        f"triton {doc.get('triton')} · SGLang {doc.get('sglang') or 'n/a'}",
        "",
        f"Command: `{doc['command']}` (Hq={doc['shape']['Hq']}, Hkv={doc['shape']['Hkv']}, "
        f"D={doc['shape']['D']}, bf16 queries; {doc['timing']}).",
        "",
        "### Time (µs) and speed-up over bf16 SDPA, 0% DEAD",
        "",
        "| B | N | SDPA bf16 | SGLang bf16 | agentkv bf16 | INT4 | INT2 | mixed 75/25 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b, n in shapes:
        cells = []
        for impl in IMPLS:
            r = rows.get((b, n, impl, 0.0, ""))
            if r is None:
                cells.append("—")
                continue
            sp = r.get("speedup_vs_sdpa")
            cells.append(
                f"{r['time_us']:.1f}" + (f" ({sp:.2f}×)" if sp and impl != "sdpa_bf16" else "")
            )
        out.append(f"| {b} | {n // 1024}k | " + " | ".join(cells) + " |")
    out += [
        "",
        "### Effective bandwidth (TB/s = bytes the kernel must read / time), 0% DEAD",
        "",
        "| B | N | SDPA bf16 | SGLang bf16 | agentkv bf16 | INT4 | INT2 | mixed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b, n in shapes:
        cells = []
        for impl in IMPLS:
            r = rows.get((b, n, impl, 0.0, ""))
            cells.append(f"{r['bandwidth_TBps']:.2f}" if r else "—")
        out.append(f"| {b} | {n // 1024}k | " + " | ".join(cells) + " |")
    out += [
        "",
        "### 50% of positions DEAD: time (speed-up over SDPA) and bytes read vs 0% DEAD",
        "",
        "`random`: every position DEAD with p = 0.5; `runs`: half of the 512-token runs DEAD "
        "(evicted spans).",
        "",
        "| B | N | impl | 0% DEAD µs | random µs | random bytes | runs µs | runs bytes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b, n in shapes:
        for impl in IMPLS[2:]:
            r0 = rows.get((b, n, impl, 0.0, ""))
            rr = rows.get((b, n, impl, 0.5, "random"))
            ru = rows.get((b, n, impl, 0.5, "runs"))
            if not (r0 and (rr or ru)):
                continue

            def cell(r, r0=r0):
                if r is None:
                    return "— | —"
                return (
                    f"{r['time_us']:.1f} ({r['speedup_vs_sdpa']:.2f}×) | "
                    f"{r['bytes'] / r0['bytes']:.2f}×"
                )

            out.append(
                f"| {b} | {n // 1024}k | {impl} | {r0['time_us']:.1f} | {cell(rr)} | {cell(ru)} |"
            )
    out += _host_tables(doc, rows, shapes)
    err_rows = [r for r in doc["results"] if r.get("rel_err_vs_ref") is not None]
    if err_rows:
        out += [
            "",
            "### Error vs the torch reference on the same quantized pools",
            "",
            "Relative L2 error of the kernel's output against a float32 "
            "`decode_attention_ref` over the first requests, with a bf16 query (and output) "
            "and with the same query in fp16; *floor*: the error of rounding that reference "
            "to the output dtype (no output of that dtype can do better).",
            "",
            "| B | N | impl | DEAD | bf16 error | bf16 floor | fp16 error | fp16 floor |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]

        def e(x: float | None) -> str:
            return "-" if x is None else f"{x:.1e}"

        for r in sorted(err_rows, key=_key):
            out.append(
                f"| {r['B']} | {r['N'] // 1024}k | {r['impl']} | "
                f"{r['dead_fraction']:.0%} {r.get('dead_pattern') or ''} | "
                f"{r['rel_err_vs_ref']:.1e} | {r['bf16_floor']:.1e} | "
                f"{e(r.get('rel_err_fp16_vs_ref'))} | {e(r.get('fp16_floor'))} |"
            )
    if doc.get("configs"):
        out += ["", "Configs used (`DecodeConfig`, after `--tune` when given):", ""]
        for impl, cfg in doc["configs"].items():
            out.append(f"- {impl}: `{json.dumps(cfg)}`")
    if doc.get("tuning"):
        out += [
            "",
            "### Tuning sweep (geometric mean over the tune shapes, best 5 per impl)",
            "",
            "| impl | geomean µs | per shape µs | config (non-default fields) |",
            "| --- | --- | --- | --- |",
        ]
        default = doc["tuning"][0]["config"] if doc["tuning"] else {}
        for impl in ("int4", "int2", "mixed"):
            t = sorted(
                (r for r in doc["tuning"] if r["impl"] == impl), key=lambda r: r["geomean_us"]
            )
            for r in t[:5]:
                diff = {k: v for k, v in r["config"].items() if default.get(k) != v}
                out.append(
                    f"| {impl} | {r['geomean_us']:.1f} | "
                    + " / ".join(f"{x:.1f}" for x in r["time_us"])
                    + f" | `{json.dumps(diff)}` |"
                )
    if doc.get("errors"):
        out += ["", "Errors recorded: " + json.dumps(doc["errors"])]
    return "\n".join(out) + "\n"


def _n(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _host_tables(doc: dict, rows: dict, shapes: list) -> list[str]:
    """Kernel time without host work vs do_bench's time, and the host cost per call (runs
    that recorded them; older JSON files have neither)."""
    if not any(r.get("kernel_us") is not None or "host_us" in r for r in doc["results"]):
        return []
    out = [
        "",
        "### Kernel vs host time per call (µs), 0% DEAD",
        "",
        "*do_bench*: the tables above (events around each call after an L2 flush; a host "
        "slower than the flush shows up here). *kernel*: CUDA graph of (flush, call) minus "
        "the flushes, no host work. *host*: CPU time per call over back-to-back calls "
        "(*python*: launches stubbed; *launch*: the rest: Triton binder, C launcher, "
        "cuLaunchKernel). SM: clock (MHz) before the row.",
        "",
        "| B | N | impl | do_bench | kernel | host | python | launch | stream | SM MHz |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for b, n in shapes:
        for impl in IMPLS:
            r = rows.get((b, n, impl, 0.0, ""))
            if r is None:
                continue
            gs = r.get("gpu_state") or {}
            out.append(
                f"| {b} | {n // 1024}k | {impl} | {r.get('do_bench_us', r['time_us']):.1f} | "
                f"{_n(r.get('kernel_us'))} | "
                f"{_n(r.get('host_us'))} | {_n(r.get('python_us'))} | {_n(r.get('launch_us'))} | "
                f"{_n(r.get('stream_us'))} | {gs.get('sm_mhz', '—')} |"
            )
    if doc.get("drift"):
        out += [
            "",
            "Drift check (agentkv bf16, 0% DEAD, first row of the shape vs once more at its "
            "end): "
            + "; ".join(
                f"B={d['B']} N={d['N'] // 1024}k do_bench {_n(d.get('first_time_us'))} → "
                f"{_n(d.get('time_us'))}, kernel {_n(d.get('first_kernel_us'))} → "
                f"{_n(d.get('kernel_us'))}"
                for d in doc["drift"]
            ),
        ]
    return out


def kernel_times(doc: dict) -> dict:
    """``doc`` with each row's time, speed-up over SDPA and bandwidth taken from its
    ``kernel_us`` (rows without one are dropped)."""
    res = [dict(r) for r in doc["results"] if r.get("kernel_us")]
    sdpa = {(r["B"], r["N"]): r["kernel_us"] for r in res if r["impl"] == "sdpa_bf16"}
    for r in res:
        r["do_bench_us"] = r["time_us"]  # (the host table's do_bench column keeps it)
        r["time_us"] = r["kernel_us"]
        base = sdpa.get((r["B"], r["N"]))
        r["speedup_vs_sdpa"] = base / r["kernel_us"] if base else None
        r["bandwidth_TBps"] = r["bytes"] / r["kernel_us"] / 1e6
    timing = "times: kernel_us, the kernels alone from a CUDA graph; " + doc["timing"]
    return {**doc, "results": res, "timing": timing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="docs/benchmarks/decode_attention.json")
    ap.add_argument("--kernel", action="store_true", help="times from kernel_us")
    args = ap.parse_args()
    doc = json.loads(Path(args.json).read_text())
    print(render(kernel_times(doc) if args.kernel else doc))


if __name__ == "__main__":
    main()
