"""Whole tau-bench sessions (no 4k cut): peak request tokens and IntentKV's worst-case live KV.

The paper reports, for sessions whose history outgrows the system block, the peak request
length and the worst-case peak live KV under its budget reading (total live KV
``<= max(B, |forced|)``). Both follow from the requests' tags alone (no model): for each
assistant turn of a trajectory the default model's chat template renders the request, the
tagger gives the forced set (actionable query + generation prompt, + the system block when
``protect_system``), and the live KV is simulated turn by turn as the engine keeps it:

- before the plan of request ``r``: ``kept[r-1] + new[r]`` (what the previous plan kept, plus
  the tokens this request adds: the previous reply and the new messages), the prefill peak;
- after it: ``min(before, max(B, forced[r]))`` (no eviction while the live KV fits ``B``).

FullCache keeps everything (live = the request); a fixed-budget baseline (SnapKV, H2O,
StreamingLLM) keeps ``min(before, B)``. Fidelity at these lengths needs the model (the GPU
replay with ``--max-tokens 8192``); this measures the memory side only.

    python benchmarks/intentkv_long_sessions.py --limit 50 --max-tokens 16384 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BUDGETS = (256, 512, 1024)


def session_rows(renderer, trace, max_tokens: int) -> list[dict[str, int]]:
    """One row per assistant turn: prompt tokens and forced-set sizes (with / without the
    system block); stops before the first request longer than ``max_tokens``."""
    rows = []
    for i, m in enumerate(trace.messages):
        if m["role"] != "assistant" or i == 0:
            continue
        tags = renderer.encode(trace.messages[:i], trace.tools)
        if len(tags) > max_tokens:
            break
        rows.append(
            {
                "prompt": len(tags),
                "system": tags.protected_prefix,
                "forced_protected": sum(tags.forced(True)),
                "forced_unprotected": sum(tags.forced(False)),
            }
        )
    return rows


def simulate(rows: list[dict[str, int]], keep) -> tuple[int, int]:
    """(peak live before a plan, peak live after one) in tokens; ``keep(before, row)`` is the
    live KV a plan leaves."""
    kept, prev_prompt, peak_before, peak_after = 0, 0, 0, 0
    for r in rows:
        before = kept + r["prompt"] - prev_prompt
        kept = keep(before, r)
        prev_prompt = r["prompt"]
        peak_before, peak_after = max(peak_before, before), max(peak_after, kept)
    return peak_before, peak_after


def policies() -> dict[str, object]:
    out: dict[str, object] = {"FullCache": lambda before, r: before}
    for b in BUDGETS:
        out[f"fixed budget {b} (SnapKV/H2O/StreamingLLM)"] = lambda before, r, b=b: min(before, b)
        for protect in (False, True):
            key = "forced_protected" if protect else "forced_unprotected"
            out[f"IntentKV {b}, protect_system={protect}"] = lambda before, r, b=b, key=key: min(
                before, max(b, r[key])
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=50, help="tau-bench trajectories (seeded sample)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="stop a session past this")
    ap.add_argument("--out", type=Path, default=Path("out/intentkv_long_sessions"))
    args = ap.parse_args()

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from agentkv.bench.traces import load_tau_bench, sample
    from agentkv.engine.chat_template import ChatRenderer
    from agentkv.engine.model_loader import resolve_model_dir

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    traces = sample(load_tau_bench(), limit=args.limit, seed=0)
    sessions = {}
    for trace in tqdm(traces, desc="sessions", unit="session"):
        rows = session_rows(renderer, trace, args.max_tokens)
        if rows:
            sessions[trace.id] = rows
    table = []
    for name, keep in policies().items():
        peaks = [simulate(rows, keep) for rows in sessions.values()]
        table.append(
            {
                "policy": name,
                "mean_peak_live_before_plan": statistics.mean(p[0] for p in peaks),
                "max_peak_live_before_plan": max(p[0] for p in peaks),
                "mean_peak_live_after_plan": statistics.mean(p[1] for p in peaks),
                "max_peak_live_after_plan": max(p[1] for p in peaks),
            }
        )
    prompts = [r["prompt"] for rows in sessions.values() for r in rows]
    summary = {
        "trajectories": len(sessions),
        "requests": len(prompts),
        "max_tokens": args.max_tokens,
        "peak_request_tokens": max(prompts),
        "median_peak_request_tokens": statistics.median(
            max(r["prompt"] for r in rows) for rows in sessions.values()
        ),
        "median_system_tokens": statistics.median(
            r["system"] for rows in sessions.values() for r in rows
        ),
        "requests_history_over_system": sum(
            r["prompt"] - r["system"] > r["system"] for rows in sessions.values() for r in rows
        ),
        "policies": table,
        "sessions": sessions,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{summary['trajectories']} trajectories, {summary['requests']} requests; peak request "
        f"{summary['peak_request_tokens']} tokens (median per session "
        f"{summary['median_peak_request_tokens']}); system block median "
        f"{summary['median_system_tokens']}; requests whose history outgrows the system block: "
        f"{summary['requests_history_over_system']}"
    )
    print("| policy | mean / max peak live KV before a plan | mean / max peak live KV after |")
    print("|---|---:|---:|")
    for r in table:
        print(
            f"| {r['policy']} | {r['mean_peak_live_before_plan']:,.0f} / "
            f"{r['max_peak_live_before_plan']:,} | {r['mean_peak_live_after_plan']:,.0f} / "
            f"{r['max_peak_live_after_plan']:,} |"
        )


if __name__ == "__main__":
    main()
