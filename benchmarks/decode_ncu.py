"""Where the decode kernels' time goes: Nsight Compute counters of one call per variant.

Run on the GPU machine (ncu on the PATH; Firecracker runtime)::

    python3 benchmarks/decode_ncu.py --out $OUT/ncu

It re-runs itself under ``ncu --clock-control none`` (the clocks left alone, as the
device notes ask), profiling the split kernel (``_decode_split_kernel``, not the merge)
of one call per variant at one shape (default B=8, N=32k, Hq=32, Hkv=8, D=128, every
position live), and writes ``<out>/ncu.csv`` (ncu's raw per-metric rows) and
``<out>/ncu.json`` / ``<out>/ncu.md``: duration, DRAM throughput and bytes, achieved
occupancy and its register limit, issue-slot use, warp instructions and the warp-stall
breakdown (cycles per issued instruction by reason) of each variant. The variants
``int4 read-only probe`` / ``int2 read-only probe`` profile ``gather_roofline.py``'s probe
(``_gather_probe``: the same rows read with the same grid, nothing computed) beside them.
With ``--source`` it also samples warp stalls per SASS instruction: ``<out>/source_<i>.csv``
and its summary ``source_<i>_top.txt`` (``--summarize CSV`` prints that summary of a saved
CSV, on any machine).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: variant name -> (impl, DecodeConfig keyword arguments)
VARIANTS: dict[str, tuple[str, dict]] = {
    "bf16": ("bf16", {}),
    "int4 default": ("int4", {}),
    "int4 knobs off": (
        "int4",
        dict(
            int4_stacked=True,
            int4_imma=False,
            int4_lazy_rescale=False,
            int4_v_subnormal=False,
            int4_v_dots8=False,
            int4_offsets32=False,
            int4_live_from_scales=False,
        ),
    ),
    "int2 default": ("int2", {}),
    "int2 hand prefetch (session 13's default)": (
        "int2",
        dict(int2_gluon=False, int2_pipelined=False, int2_lazy_rescale=True),
    ),
    "int2 folded byte codes w1": ("int2", dict(int2_gluon=False, int2_v_words=False)),
    "int2 folded v-words no prefetch": (
        "int2",
        dict(int2_gluon=False, int2_pipelined=False, prefetch=False),
    ),
    "int2 folded v-words w2": ("int2", dict(int2_gluon=False, num_warps=2)),
    "int2 dequantizing": ("int2", dict(int2_gluon=False, int2_fold=False)),
    "int4 session-10 default": ("int4", dict(int4_live_from_scales=False)),
    "int4 uncapped splits": ("int4", dict(max_split_len_folded=0)),
    "int4 split-fastest grid": ("int4", dict(heads_fastest=False)),
    "int4 centred": ("int4", dict(int4_v_subnormal=False, int4_v_centred=True)),
    "int4 value scales gathered": ("int4", dict(int4_v_scales_by_dot=False)),
    "int4 scales gathered (no row tile)": ("int4", dict(int4_scale_tile=False)),
    "int4 default, 184 registers": ("int4", dict(max_registers=184)),
    "int4 default, 5 stages": ("int4", dict(num_stages=5)),
    "int2 split-fastest grid": ("int2", dict(int2_gluon=False, heads_fastest=False)),
    "int2 Triton split (the default before session 18)": ("int2", dict(int2_gluon=False)),
    "int4 Triton split (the default before session 19)": ("int4", dict(int4_gluon=False)),
    # gather_roofline.py's read-only probe: the same rows read, nothing computed
    "int4 read-only probe": ("probe", dict(layout="int4 pool")),
    "int2 read-only probe": ("probe", dict(layout="int2 pages")),
    # (consecutive rows, a head's positions in row order: the store's rows before any churn)
    "int4 head-major read-only probe": ("probe", dict(layout="int4 head-major", scatter=False)),
}
KERNELS = (
    "_decode_split_kernel",
    "int2_split_gluon_kernel",
    "int4_split_gluon_kernel",
    "mixed_split_gluon_kernel",
    "_gather_probe",
)

METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct_of_peak",
    "dram__bytes_read.sum": "dram_bytes_read",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__occupancy_limit_registers": "blocks_per_sm_limit_registers",
    "launch__registers_per_thread": "registers_per_thread",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__inst_executed.sum": "warp_instructions",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible_warps_per_cycle",
    "launch__occupancy_limit_shared_mem": "blocks_per_sm_limit_shared_mem",
    "launch__shared_mem_config_size": "shared_mem_config_bytes",
}
STALLS = (
    "long_scoreboard",
    "short_scoreboard",
    "barrier",
    "wait",
    "math_pipe_throttle",
    "mio_throttle",
    "lg_throttle",
    "not_selected",
    "selected",
    "dispatch_stall",
    "no_instruction",
    "branch_resolving",
    "membar",
    "tex_throttle",
    "drain",
    "imc_miss",
    "sleeping",
    "misc",
)
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def child(b: int, n: int, names: list[str], slots: str = "random") -> None:
    """Build the shape (token slots laid out as ``slots``: ``decode_attention.slot_order``,
    e.g. ``sorted-live/head`` for the store's rows), compile every variant, then profile one
    call of each."""
    import torch
    from decode_attention import DecodeConfig, Shape, _ours
    from gather_roofline import planned_split_len, probe_fn

    s = Shape(b, n, slots=slots)
    s.drop_sdpa_kv()
    fns = [
        probe_fn(
            VARIANTS[k][1]["layout"],
            b,
            n,
            VARIANTS[k][1].get("scatter", True),
            planned_split_len(b, n),
        )[0]
        if VARIANTS[k][0] == "probe"
        else _ours(s, VARIANTS[k][0], False, DecodeConfig(**VARIANTS[k][1]))
        for k in names
    ]
    for fn in fns:  # compile and warm outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in zip(names, fns, strict=True):
        print(f"profiling {name}", flush=True)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
    """ncu's raw-page CSV rows (one per profiled kernel, a column per metric; the first row
    after the header holds the units) -> one dict per profiled variant, in launch order."""
    kernels = [r for r in rows if any(k in r.get("Kernel Name", "") for k in KERNELS)]
    out = []
    for name, met in zip(names, kernels, strict=False):

        def num(key: str, met: dict = met) -> float | None:
            v = met.get(key)
            try:
                return float(str(v).replace(",", ""))
            except (TypeError, ValueError):
                return None

        row = {"variant": name, "config": VARIANTS[name][1]}
        row.update({short: num(key) for key, short in METRICS.items()})
        stalls = {k: num(STALL_METRIC.format(k)) for k in STALLS}
        row["stall_cycles_per_issue"] = {k: v for k, v in stalls.items() if v}
        out.append(row)
    return out


def markdown(summary: list[dict], b: int, n: int) -> str:
    head = (
        f"B={b}, N={n}, Hq=32, Hkv=8, D=128, 0% DEAD; one call per variant, "
        "`ncu --clock-control none`\n\n"
        "| variant | µs | DRAM % peak | GB read | occupancy % | regs | issue active % | "
        "warp instr (M) | top stalls (cycles per issued instr) |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n"
    )
    lines = []
    for r in summary:
        st = sorted(r["stall_cycles_per_issue"].items(), key=lambda x: -x[1])[:4]

        def f(x: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
            return "-" if x is None else format(x * scale, spec)

        lines.append(
            f"| {r['variant']} | {f(r['duration_ns'], 1e-3)} | {f(r['dram_pct_of_peak'])} | "
            f"{f(r['dram_bytes_read'], 1e-9, '.3f')} | {f(r['achieved_occupancy_pct'])} | "
            f"{f(r['registers_per_thread'], 1, '.0f')} | {f(r['issue_active_pct'])} | "
            f"{f(r['warp_instructions'], 1e-6, '.2f')} | "
            + ", ".join(f"{k} {v:.1f}" for k, v in st)
            + " |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("ncu_out"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--variants", default=";".join(VARIANTS), help="names, ';'-separated")
    ap.add_argument(
        "--slots",
        default="random",
        help="token slot layout of the kernels' variants (decode_attention.py --slots; the "
        "read-only probes keep their own)",
    )
    ap.add_argument(
        "--source",
        action="store_true",
        help="also sample warp stalls per SASS instruction (<out>/source_<i>.csv per variant)",
    )
    ap.add_argument(
        "--summarize",
        type=Path,
        help="only print top_stalls of a saved source CSV (ncu's source page), no profiling",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.summarize:
        print(top_stalls(args.summarize.read_text()), end="")
        return
    names = [v for v in args.variants.split(";") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    if args.child:
        child(args.batch, args.tokens, names, args.slots)
        return
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    metrics = list(METRICS) + [STALL_METRIC.format(k) for k in STALLS]
    cmd = [
        ncu,
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "-k",
        "regex:" + "|".join(KERNELS),
        "--metrics",
        ",".join(metrics),
        "--csv",
        "--page",
        "raw",
        sys.executable,
        __file__,
        "--child",
        "--batch",
        str(args.batch),
        "--tokens",
        str(args.tokens),
        "--variants",
        ";".join(names),
        "--slots",
        args.slots,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    (args.out / "ncu.log").write_text(res.stderr)
    text = res.stdout
    (args.out / "ncu.csv").write_text(text)  # the raw page: a row per kernel
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    summary = summarize(rows, names)
    (args.out / "ncu.json").write_text(json.dumps(summary, indent=1))
    md = markdown(summary, args.batch, args.tokens)
    (args.out / "ncu.md").write_text(md)
    print(md)
    if not summary:
        print(res.stderr[-3000:])
        raise SystemExit(f"ncu gave no rows (exit {res.returncode})")
    if args.source:
        source_stalls(ncu, args, names)


def source_stalls(ncu: str, args: argparse.Namespace, names: list[str]) -> None:
    """Warp-state samples per SASS instruction (ncu's source page), one CSV per variant:
    which instructions the warps wait at, and for what."""
    rep = args.out / "source"
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off"]
    cmd += ["-k", "regex:" + "|".join(KERNELS), "--section", "SourceCounters"]
    cmd += ["--section", "WarpStateStats", "-f", "-o", str(rep), sys.executable, __file__]
    cmd += ["--child", "--batch", str(args.batch), "--tokens", str(args.tokens)]
    cmd += ["--variants", ";".join(names), "--slots", args.slots]
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    (args.out / "source.log").write_text(res.stdout[-20000:] + res.stderr[-20000:])
    for i in range(len(names)):
        page = subprocess.run(
            [ncu, "--import", f"{rep}.ncu-rep", "--page", "source", "--csv"]
            + ["--print-source", "sass", "--launch-skip", str(i), "--launch-count", "1"],
            capture_output=True,
            text=True,
        )
        (args.out / f"source_{i}.csv").write_text(page.stdout or page.stderr)
        if page.stdout:
            (args.out / f"source_{i}_top.txt").write_text(top_stalls(page.stdout))


def top_stalls(source_csv: str, n: int = 30) -> str:
    """ncu's source page (``--page source --csv --print-source sass``) -> the kernel's
    warp-stall reasons (share of all samples) and the ``n`` SASS instructions with the
    most samples, each with its three largest reasons: where the warps wait, and for
    what."""
    lines = source_csv.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        return "no source rows\n"
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]

    def num(x: str | None) -> float:
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
    by_reason = {k: sum(num(r[k]) for r in rows) for k in reasons}
    out = [f"{int(total)} samples over {len(rows)} SASS instructions"]
    for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1]):
        if v:
            out.append(f"  {k[6:]:20s} {100 * v / total:5.1f}%")
    out.append(f"top {n} instructions (share of samples, executions, top reasons):")
    ranked = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))
    for r in ranked[:n]:
        share = 100 * num(r["Warp Stall Sampling (All Samples)"]) / total
        top = sorted(((num(r[k]), k[6:]) for k in reasons), reverse=True)[:3]
        why = " ".join(f"{k}={100 * v / total:.1f}" for v, k in top if v)
        out.append(
            f"{share:5.1f}% {r['Address'][-5:]} {r['Source'].strip()[:56]:56s} "
            f"x{num(r['Instructions Executed']):.0f} {why}"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
