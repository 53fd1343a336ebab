"""Join replay results that ran different policy sets on overlapping trajectories.

`agentkv bench merge` joins shards of one run (same policies, disjoint trajectories). A
device budget often splits one comparison into runs with different policy lists on the same
seeded sample; this script takes the policies you name from every ``results.json`` that has
them and writes one report (``results.json``, ``summary.md``, ``fidelity_vs_memory.png``):

    python benchmarks/join_replay.py a/results.json b/results.json --out DIR \
        --policy full --policy snapkv:budget=512 --policy "kvzap(surrogate=linear)"

A (trajectory, turn) record is taken from the first file that has it for that policy. Each
policy is summarised over the trajectories it ran (``--common`` keeps only trajectories that
every named policy ran, so that all rows share one sample). Fidelity is always against the
FullCache reference of the run that produced the record; the engine's reference is
deterministic for a given device and code, so references of two runs on the same machine
type agree (check with ``full``'s row: top-1 1.000, KL 0).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections import defaultdict
from pathlib import Path

from agentkv.bench.replay import ReplayReport, TurnRecord, summarize, write_outputs
from agentkv.policies import parse_policy, parse_policy_spec


def _label(name: str, known: set[str]) -> str:
    if name in known:
        return name
    label = parse_policy_spec(name).describe()
    if label not in known:
        raise SystemExit(f"no policy {name!r} in the inputs")
    return label


def join(paths: list[Path], names: list[str], common: bool = False) -> ReplayReport:
    docs = [json.loads(p.read_text()) for p in paths]
    known = {p["label"] for d in docs for p in d["policies"]}
    labels = [_label(n, known) for n in names]
    policies, turns = {}, {}
    for label in labels:
        seen: set[tuple[str, int]] = set()
        rows: list[TurnRecord] = []
        for d in docs:
            spec = next((p["policy"] for p in d["policies"] if p["label"] == label), None)
            if spec is None:
                continue
            policies.setdefault(label, parse_policy(spec))
            for r in d["turns"][label]:
                if (r["trace"], r["turn"]) not in seen:
                    seen.add((r["trace"], r["turn"]))
                    rows.append(TurnRecord(**r))
        turns[label] = rows
    traces: list[str] = []
    for d in docs:
        traces += [t for t in d["traces"] if t not in traces]
    if common:
        shared = set.intersection(*({r.trace for r in rows} for rows in turns.values()))
        traces = [t for t in traces if t in shared]
        turns = {k: [r for r in v if r.trace in shared] for k, v in turns.items()}
    first = docs[0]
    return ReplayReport(
        model=first["model"],
        device=first["device"],
        date=first["date"],
        command="python benchmarks/join_replay.py "
        + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        traces=traces,
        greedy_tokens=first["greedy_tokens"],
        max_tokens=first["max_tokens"],
        summaries=[summarize(label, policies[label], turns[label]) for label in labels],
        turns=turns,
    )


_KNOB = re.compile(r"(?:budget|threshold)=(-?[\d.]+)(?:, )?")


def plot_grouped(report: ReplayReport, path: Path) -> None:
    """Top-1 agreement vs mean peak resident KV, one line per method and fixed knobs, the
    budget or threshold varying along it (so KVzap's thresholds form one curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(list)
    for s in report.summaries:
        family = _KNOB.sub("", s.label).replace("()", "").replace("(, ", "(").replace(", )", ")")
        knob = s.budget if s.budget is not None else s.policy.get("threshold", "")
        groups[family].append((s, str(knob)))
    fig, ax = plt.subplots(figsize=(10, 5))
    for family, items in groups.items():
        items.sort(key=lambda i: i[0].mean_peak_resident_kv_bytes)
        x = [s.mean_peak_resident_kv_bytes / 2**20 for s, _ in items]
        y = [s.top1_agreement for s, _ in items]
        lo = [v - s.top1_ci95[0] for v, (s, _) in zip(y, items, strict=True)]
        hi = [s.top1_ci95[1] - v for v, (s, _) in zip(y, items, strict=True)]
        style = {"marker": "*", "markersize": 14, "color": "black"} if family == "full" else {}
        ax.errorbar(x, y, yerr=[lo, hi], capsize=2, elinewidth=0.7, label=family, **style)
        for (_, knob), xi, yi in zip(items, x, y, strict=True):
            ax.annotate(knob, (xi, yi), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("mean peak resident KV (MiB)")
    ax.set_ylabel("top-1 agreement with FullCache (95% CI)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{len(report.traces)} trajectories, {report.model}; labels: budget or threshold")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="results.json files of replay runs")
    ap.add_argument("--policy", action="append", required=True, help="label or spec; repeat")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--common", action="store_true", help="only trajectories every policy ran")
    args = ap.parse_args()
    report = join(args.results, args.policy, args.common)
    paths = write_outputs(report, args.out)
    plot_grouped(report, paths["plot"])
    for s in report.summaries:
        n = len({r.trace for r in report.turns[s.label]})
        print(f"{s.label}: {n} trajectories, {s.turns} turns, top-1 {s.top1_agreement:.3f}")
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)


if __name__ == "__main__":
    main()
