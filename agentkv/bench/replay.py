"""Agent-trajectory replay: fidelity, memory and prefix reuse of every policy on real traces.

Each trajectory is replayed turn by turn through the embedded engine with prefix caching on,
once under FullCache (the reference) and once per policy, each in its own session starting
from an empty prefix cache (so prefix hits come from the session's own earlier turns). At
every assistant message of the trace the engine teacher-forces the reference assistant tokens
on the context as the policy holds it after its evictions, and continues greedily for
``greedy_tokens`` tokens from the same state (the reference decodes step by step; then the
reference and each policy take the argmax after each prefix of that continuation in one
teacher-forced pass, :meth:`Engine.score`'s ``greedy_check``):

- fidelity vs FullCache: top-1 agreement and mean KL(full || policy) over the reference
  assistant tokens, NLL delta (policy - full, nats/token), greedy exact match of the first
  ``greedy_tokens`` tokens (the policy's argmax equals FullCache's at every step of
  FullCache's greedy continuation: greedy decoding's exact match, with both sides computed
  the same way so that rounding cannot flip a near-tie on one side only);
- memory and work: peak request tokens, peak live KV tokens and bytes, raw and effective KV
  reads, prefix-hit rate on turns >= 2, wall time; per node when the trace's assistant
  messages carry a ``node`` key.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

from agentkv.bench.bootstrap import paired_difference_ci, ratio_ci
from agentkv.bench.encode_memo import MemoRenderer
from agentkv.bench.traces import Trace, load_jsonl, load_source
from agentkv.engine.engine import Engine, ScoreResult
from agentkv.policies import FullCache, KVPolicy, parse_policy_spec
from agentkv.wire import build_payload

REFERENCE = FullCache()


@dataclass
class TurnRecord:
    """One assistant turn of one trajectory under one policy."""

    trace: str
    turn: int  # message index of the assistant message
    node: str | None
    target_tokens: int
    top1_agree: int  # positions where argmax equals FullCache's
    kl_sum: float  # sum over positions of KL(full || policy), nats
    nll_sum: float  # policy NLL of the reference tokens, nats
    nll_full_sum: float
    greedy_match: bool
    prompt_tokens: int
    prefix_hit_tokens: int
    peak_request_tokens: int
    live_kv_tokens: float
    planned_live_kv_tokens: float
    live_kv_bytes: int
    forced_tokens: int
    raw_kv_reads: int
    effective_kv_reads: int
    wall_time_s: float
    resident_kv_bytes: int = 0  # what the pools hold (all precisions); 0 in older results
    quantized_entries: int = 0
    plan_time_s: float = 0.0  # observer result + scoring + applying the plan; 0 in older results


@dataclass
class PolicySummary:
    label: str
    policy: dict[str, Any]
    budget: int | None
    turns: int = 0
    tokens: int = 0
    top1_agreement: float = 0.0
    top1_ci95: tuple[float, float] = (0.0, 0.0)  # bootstrap over trajectories
    mean_kl: float = 0.0
    nll_delta: float = 0.0
    greedy_exact_match: float = 0.0
    greedy_ci95: tuple[float, float] = (0.0, 0.0)
    peak_request_tokens: int = 0
    mean_peak_live_kv_tokens: float = 0.0
    max_live_kv_tokens: float = 0.0
    mean_peak_live_kv_bytes: float = 0.0
    mean_peak_resident_kv_bytes: float = 0.0  # the memory a server could give to others
    max_planned_over_budget: float = 0.0  # max of planned live - (budget + forced); <= 0 holds
    raw_kv_reads: int = 0
    effective_kv_reads: int = 0
    prefix_hit_rate_turn2plus: float = 0.0
    wall_time_s: float = 0.0
    mean_plan_ms: float = 0.0  # per request: observer result + scoring + applying the plan
    per_node: dict[str, dict[str, float]] = field(default_factory=dict)


def fidelity(
    ref_logits: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
) -> dict[str, float]:
    """Fidelity of ``logits`` vs ``ref_logits`` (both float32 ``[n, V]``) on ``target [n]``."""
    lp_ref = torch.log_softmax(ref_logits.float(), dim=-1)
    lp = torch.log_softmax(logits.float(), dim=-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1).clamp_min(0)
    idx = torch.arange(target.numel())
    return {
        "top1_agree": int((ref_logits.argmax(-1) == logits.argmax(-1)).sum()),
        "kl_sum": float(kl.sum()),
        "nll_sum": float(-lp[idx, target].sum()),
        "nll_full_sum": float(-lp_ref[idx, target].sum()),
    }


def assistant_turns(messages: Sequence[dict[str, Any]]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant" and i > 0]


def truncate(engine: Engine, trace: Trace, max_tokens: int) -> list[dict[str, Any]]:
    """The longest prefix of the trace ending with an assistant message that renders within
    ``max_tokens`` tokens (and the model's context)."""
    limit = min(max_tokens, engine.max_context)
    best = 0
    for i in assistant_turns(trace.messages):
        n = len(
            engine.renderer.encode(
                trace.messages[: i + 1], trace.tools, add_generation_prompt=False
            )
        )
        if n > limit:
            break
        best = i + 1
    return [dict(m) for m in trace.messages[:best]]


def _session(trace: Trace, label: str) -> str:
    return f"replay/{trace.id}/{label}"


def _run_policy(
    engine: Engine,
    trace: Trace,
    messages: list[dict[str, Any]],
    policy: KVPolicy,
    label: str,
    greedy_tokens: int,
    reference: dict[int, ScoreResult] | None,
) -> tuple[list[TurnRecord], dict[int, ScoreResult]]:
    session = _session(trace, label)
    records, results = [], {}
    try:
        for i in assistant_turns(messages):
            node = messages[i].get("node")
            payload = build_payload(messages[:i], policy, session, node=node)
            res = engine.score(
                messages[:i],
                messages[i],
                trace.tools,
                payload,
                greedy_tokens=greedy_tokens,
                # the reference decodes greedily; the others check its continuation in one pass
                greedy_reference=None if reference is None else reference[i].greedy_ids,
            )
            results[i] = res
            ref = reference[i] if reference is not None else res
            fid = fidelity(ref.logits, res.logits, res.target_ids)
            u = res.usage
            records.append(
                TurnRecord(
                    trace=trace.id,
                    turn=i,
                    node=node,
                    target_tokens=int(res.target_ids.numel()),
                    # same greedy choices along the reference continuation, both teacher-forced
                    greedy_match=res.greedy_check == ref.greedy_check,
                    prompt_tokens=u.prompt_tokens,
                    prefix_hit_tokens=u.prefix_hit_tokens,
                    peak_request_tokens=u.peak_request_tokens,
                    live_kv_tokens=u.live_kv_tokens,
                    planned_live_kv_tokens=u.planned_live_kv_tokens,
                    live_kv_bytes=u.live_kv_bytes,
                    forced_tokens=u.forced_tokens,
                    raw_kv_reads=u.raw_kv_reads,
                    effective_kv_reads=u.effective_kv_reads,
                    wall_time_s=u.wall_time_s,
                    resident_kv_bytes=u.resident_kv_bytes,
                    quantized_entries=u.quantized_entries,
                    plan_time_s=u.plan_time_s,
                    **fid,
                )
            )
    finally:
        engine.end_session(session)
        engine.store.flush_prefix_cache()
    return records, results


def per_trajectory(
    records: Sequence[TurnRecord], value: Callable[[TurnRecord], float]
) -> dict[str, float]:
    """Sum of ``value`` over each trajectory's turns, keyed by trajectory id."""
    sums: dict[str, float] = defaultdict(float)
    for r in records:
        sums[r.trace] += value(r)
    return dict(sums)


def top1_ci95(records: Sequence[TurnRecord]) -> tuple[float, float]:
    """Bootstrap 95% interval of top-1 agreement, resampling whole trajectories."""
    agree = per_trajectory(records, lambda r: r.top1_agree)
    tokens = per_trajectory(records, lambda r: r.target_tokens)
    return ratio_ci([agree[t] for t in tokens], list(tokens.values()))


def summarize(label: str, policy: KVPolicy, records: Sequence[TurnRecord]) -> PolicySummary:
    budget = getattr(policy, "budget", None)
    s = PolicySummary(label=label, policy=policy.model_dump(), budget=budget)
    if not records:
        return s
    tokens = sum(r.target_tokens for r in records)
    s.turns, s.tokens = len(records), tokens
    s.top1_agreement = sum(r.top1_agree for r in records) / tokens
    s.mean_kl = sum(r.kl_sum for r in records) / tokens
    s.nll_delta = (sum(r.nll_sum for r in records) - sum(r.nll_full_sum for r in records)) / tokens
    s.greedy_exact_match = sum(r.greedy_match for r in records) / len(records)
    s.top1_ci95 = top1_ci95(records)
    matches = per_trajectory(records, lambda r: r.greedy_match)
    turns = per_trajectory(records, lambda r: 1)
    s.greedy_ci95 = ratio_ci([matches[t] for t in turns], list(turns.values()))
    s.peak_request_tokens = max(r.peak_request_tokens for r in records)
    by_trace: dict[str, list[TurnRecord]] = defaultdict(list)
    for r in records:
        by_trace[r.trace].append(r)
    peaks = [max(r.live_kv_tokens for r in rs) for rs in by_trace.values()]
    peak_bytes = [max(r.live_kv_bytes for r in rs) for rs in by_trace.values()]
    s.mean_peak_live_kv_tokens = sum(peaks) / len(peaks)
    s.max_live_kv_tokens = max(peaks)
    s.mean_peak_live_kv_bytes = sum(peak_bytes) / len(peak_bytes)
    peak_res = [max(r.resident_kv_bytes or r.live_kv_bytes for r in rs) for rs in by_trace.values()]
    s.mean_peak_resident_kv_bytes = sum(peak_res) / len(peak_res)
    if budget is not None and policy.evicts:
        s.max_planned_over_budget = max(
            r.planned_live_kv_tokens - (budget + r.forced_tokens) for r in records
        )
    s.raw_kv_reads = sum(r.raw_kv_reads for r in records)
    s.effective_kv_reads = sum(r.effective_kv_reads for r in records)
    later = [r for rs in by_trace.values() for r in sorted(rs, key=lambda r: r.turn)[1:]]
    prompt = sum(r.prompt_tokens for r in later)
    s.prefix_hit_rate_turn2plus = (
        sum(r.prefix_hit_tokens for r in later) / prompt if prompt else 0.0
    )
    s.wall_time_s = sum(r.wall_time_s for r in records)
    s.mean_plan_ms = 1000 * sum(r.plan_time_s for r in records) / len(records)
    nodes: dict[str, list[TurnRecord]] = defaultdict(list)
    for r in records:
        if r.node:
            nodes[r.node].append(r)
    for node, rs in nodes.items():
        n_tok = sum(r.target_tokens for r in rs)
        s.per_node[node] = {
            "turns": len(rs),
            "top1_agreement": sum(r.top1_agree for r in rs) / n_tok,
            "mean_kl": sum(r.kl_sum for r in rs) / n_tok,
            "peak_live_kv_tokens": max(r.live_kv_tokens for r in rs),
            "prefix_hit_tokens": sum(r.prefix_hit_tokens for r in rs),
        }
    return s


@dataclass
class ReplayReport:
    model: str
    device: str
    date: str
    command: str
    traces: list[str]
    greedy_tokens: int
    max_tokens: int
    summaries: list[PolicySummary]
    turns: dict[str, list[TurnRecord]]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "date": self.date,
            "command": self.command,
            "machine": platform.platform(),
            "traces": self.traces,
            "greedy_tokens": self.greedy_tokens,
            "max_tokens": self.max_tokens,
            "policies": [asdict(s) for s in self.summaries],
            "turns": {k: [asdict(r) for r in v] for k, v in self.turns.items()},
        }


def replay(
    engine: Engine,
    traces: Sequence[Trace],
    policies: Sequence[KVPolicy],
    greedy_tokens: int = 32,
    max_tokens: int = 4096,
    progress: bool = True,
    command: str = "",
    on_trace: Callable[[ReplayReport], None] | None = None,
    max_seconds: float | None = None,
) -> ReplayReport:
    """Replay ``traces`` under FullCache (reference) and each of ``policies``.

    ``on_trace`` receives the report so far after each trajectory (for checkpointing); no new
    trajectory starts after ``max_seconds``."""
    t_start = time.perf_counter()
    from tqdm.auto import tqdm

    labels = [p.describe() for p in policies]
    records: dict[str, list[TurnRecord]] = {label: [] for label in labels}
    used: list[str] = []
    bar = tqdm(
        total=len(traces) * (len(policies) + 1), desc="replay", unit="run", disable=not progress
    )
    for trace in traces:
        if max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            print(f"time budget reached after {len(used)} trajectories", file=sys.stderr)
            break
        messages = truncate(engine, trace, max_tokens)
        if not assistant_turns(messages):
            bar.update(len(policies) + 1)
            continue
        used.append(trace.id)
        bar.set_postfix_str(f"{trace.id} reference")
        _, reference = _run_policy(
            engine, trace, messages, REFERENCE, "reference", greedy_tokens, None
        )
        bar.update(1)
        for policy, label in zip(policies, labels, strict=True):
            bar.set_postfix_str(f"{trace.id} {label}")
            recs, _ = _run_policy(engine, trace, messages, policy, label, greedy_tokens, reference)
            records[label].extend(recs)
            bar.update(1)
        del reference
        if on_trace is not None:
            on_trace(
                _report(engine, policies, labels, records, used, greedy_tokens, max_tokens, command)
            )
    bar.close()
    return _report(engine, policies, labels, records, used, greedy_tokens, max_tokens, command)


def _device_name(engine: Engine) -> str:
    if engine.device.type == "cuda":
        return f"{engine.device} ({torch.cuda.get_device_name(engine.device)})"
    return f"{engine.device} ({platform.processor() or platform.machine()})"


def _report(
    engine, policies, labels, records, used, greedy_tokens, max_tokens, command
) -> ReplayReport:
    summaries = [
        summarize(label, p, records[label]) for p, label in zip(policies, labels, strict=True)
    ]
    return ReplayReport(
        model=engine.model_name,
        device=_device_name(engine),
        date=date.today().isoformat(),
        command=command,
        traces=list(used),
        greedy_tokens=greedy_tokens,
        max_tokens=max_tokens,
        summaries=summaries,
        turns={k: list(v) for k, v in records.items()},
    )


def summary_table(report: ReplayReport) -> str:
    lines = [
        f"| policy | top-1 agree [95% CI] | mean KL | ΔNLL | greedy EM@{report.greedy_tokens} | peak req tokens | mean peak live KV "
        "tokens | mean peak live KV MiB | mean peak resident KV MiB | eff/raw KV reads | prefix-hit rate (turn≥2) | plan ms | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.summaries:
        ratio = s.effective_kv_reads / s.raw_kv_reads if s.raw_kv_reads else 0.0
        lines.append(
            f"| {s.label} | {s.top1_agreement:.3f} [{s.top1_ci95[0]:.3f}, {s.top1_ci95[1]:.3f}] | {s.mean_kl:.4f} | {s.nll_delta:+.4f} "
            f"| {s.greedy_exact_match:.2f} | {s.peak_request_tokens} | {s.mean_peak_live_kv_tokens:.0f} "
            f"| {s.mean_peak_live_kv_bytes / 2**20:.1f} | {s.mean_peak_resident_kv_bytes / 2**20:.1f} "
            f"| {ratio:.2f} | {s.prefix_hit_rate_turn2plus:.2f} "
            f"| {s.mean_plan_ms:.1f} | {s.wall_time_s:.0f} |"
        )
    return "\n".join(lines)


def write_outputs(report: ReplayReport, out: Path) -> dict[str, Path]:
    """``results.json``, ``summary.md`` and ``fidelity_vs_memory.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out / "results.json",
        "summary": out / "summary.md",
        "plot": out / "fidelity_vs_memory.png",
    }
    paths["results"].write_text(json.dumps(report.to_json(), indent=1))
    head = (
        f"# Replay: {len(report.traces)} trajectories, {report.model} on {report.device}, {report.date}\n\n"
        f"Command: `{report.command}`\n\nFidelity is measured against FullCache, teacher-forced on every "
        f"assistant message (traces truncated to {report.max_tokens} tokens); greedy EM: the policy makes "
        f"FullCache's greedy choice at each of FullCache's first {report.greedy_tokens} greedy tokens "
        f"(teacher-forced). The 95% intervals resample whole "
        f"trajectories (bootstrap).\n\n"
    )
    paths["summary"].write_text(head + summary_table(report) + "\n")
    plot(report, paths["plot"])
    return paths


def _family(s: PolicySummary) -> str:
    """Plot series: the method plus any non-default knob other than the budget."""
    label = s.label
    if s.budget is not None:
        label = label.replace(f"budget={s.budget}", "").replace("(, ", "(").replace("()", "")
    return label.rstrip("(").replace("()", "") or s.policy["method"]


def plot(report: ReplayReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[str, list[PolicySummary]] = defaultdict(list)
    for s in report.summaries:
        groups[_family(s)].append(s)
    for family, items in groups.items():
        items = sorted(items, key=lambda s: s.mean_peak_resident_kv_bytes)
        x = [s.mean_peak_resident_kv_bytes / 2**20 for s in items]
        style = {"marker": "o", "markersize": 5, "label": family}
        if family == "full":
            style = {
                "marker": "*",
                "markersize": 14,
                "label": family,
                "color": "black",
                "zorder": 5,
            }
        y = [s.top1_agreement for s in items]
        yerr = [[yi - s.top1_ci95[0] for yi, s in zip(y, items, strict=True)]]
        yerr.append([s.top1_ci95[1] - yi for yi, s in zip(y, items, strict=True)])
        axes[0].errorbar(x, y, yerr=yerr, capsize=2, elinewidth=0.8, **style)
        axes[1].plot(x, [max(s.mean_kl, 1e-6) for s in items], **style)
        for s, xi in zip(items, x, strict=True):
            if s.budget is not None:
                axes[0].annotate(
                    str(s.budget),
                    (xi, s.top1_agreement),
                    fontsize=7,
                    xytext=(3, -9),
                    textcoords="offset points",
                )
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].set_ylabel("top-1 agreement with FullCache (95% CI)")
    axes[1].set_ylabel("mean KL(full || policy), nats")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("mean peak resident KV (MiB, what the pools hold)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Fidelity vs memory — {len(report.traces)} trajectories, {report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_traces(
    traces: Path | None, source: str | None, limit: int | None, seed: int = 0
) -> list[Trace]:
    if (traces is None) == (source is None):
        raise ValueError("give either a TRACES.jsonl file or --source tau-bench|bfcl")
    if traces is not None:
        loaded = load_jsonl(traces)
        return loaded[:limit] if limit else loaded
    return load_source(source, limit=limit, seed=seed)


def run_replay_cli(
    traces: Path | None,
    source: str | None,
    policies: Sequence[str],
    limit: int | None,
    out: Path,
    model: str | None,
    device: str | None,
    max_tokens: int,
    greedy_tokens: int = 32,
    skip: int = 0,
    max_seconds: float | None = None,
    shard: str | None = None,
    skip_done: Sequence[Path] = (),
) -> ReplayReport | None:
    parsed = [parse_policy_spec(p) for p in policies]
    loaded = load_traces(traces, source, limit)[skip:]
    done = {t for p in skip_done for t in json.loads(Path(p).read_text())["traces"]}
    loaded = [t for t in loaded if t.id not in done]
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 0 <= index < count:
            raise ValueError(f"--shard must be i/n with 0 <= i < n, got {shard!r}")
        loaded = loaded[index::count]
    if not loaded:
        print("nothing to replay: every selected trajectory is skipped or done", file=sys.stderr)
        return None
    t0 = time.perf_counter()
    engine = Engine(model, device=device)
    engine.renderer = MemoRenderer(engine.renderer)  # each turn's prompt: once, not per policy
    print(
        f"engine: {engine.model_name} on {engine.device} ({time.perf_counter() - t0:.1f}s); "
        f"{len(loaded)} trajectories x {len(parsed)} policies (+ reference)",
        file=sys.stderr,
    )
    command = "agentkv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = replay(
        engine,
        loaded,
        parsed,
        greedy_tokens=greedy_tokens,
        max_tokens=max_tokens,
        command=command,
        on_trace=lambda partial: write_outputs(partial, out),
        max_seconds=max_seconds,
    )
    if loaded and not report.traces and (max_seconds is None or max_seconds > 0):
        raise ValueError(
            f"no trajectory replayed: none of the {len(loaded)} has an assistant turn within "
            f"--max-tokens {max_tokens} (a trajectory is cut before its first request longer "
            "than that); raise --max-tokens"
        )
    paths = write_outputs(report, out)
    print(summary_table(report))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return report


#: arguments that differ between the shards of one run (dropped from the merged command)
_SHARD_ARGS = re.compile(r" --(?:shard|out)(?:=| )\S+")


def merge_results(paths: Sequence[Path], command: str = "") -> ReplayReport:
    """One report from several ``results.json`` of the same policies (shards of one run)."""
    from agentkv.policies import parse_policy

    docs = [json.loads(Path(p).read_text()) for p in paths]
    first = docs[0]
    labels = [p["label"] for p in first["policies"]]
    for d in docs[1:]:
        if [p["label"] for p in d["policies"]] != labels:
            raise ValueError("results to merge must list the same policies in the same order")
    policies = [parse_policy(p["policy"]) for p in first["policies"]]
    turns: dict[str, list[TurnRecord]] = {label: [] for label in labels}
    traces: list[str] = []
    for d in docs:
        traces += [t for t in d["traces"] if t not in traces]
        for label in labels:
            turns[label] += [TurnRecord(**r) for r in d["turns"][label]]
    summaries = [
        summarize(label, p, turns[label]) for p, label in zip(policies, labels, strict=True)
    ]
    return ReplayReport(
        model=first["model"],
        device=first["device"],
        date=first["date"],
        command=command or _SHARD_ARGS.sub("", first["command"]),
        traces=traces,
        greedy_tokens=first["greedy_tokens"],
        max_tokens=first["max_tokens"],
        summaries=summaries,
        turns=turns,
    )


@dataclass
class PairedComparison:
    """Top-1 agreement of policy ``a`` minus policy ``b`` on the trajectories both ran."""

    a: str
    b: str
    trajectories: int
    top1_difference: float
    ci95: tuple[float, float]

    def __str__(self) -> str:
        lo, hi = self.ci95
        verdict = (
            f"{self.a} agrees more"
            if lo > 0
            else f"{self.b} agrees more"
            if hi < 0
            else "no difference at 95%"
        )
        return (
            f"{self.a} - {self.b}: top-1 agreement {self.top1_difference:+.4f} "
            f"[95% CI {lo:+.4f}, {hi:+.4f}] over {self.trajectories} trajectories: {verdict}"
        )


def compare_policies(report: ReplayReport, a: str, b: str) -> PairedComparison:
    """Paired bootstrap of top-1 agreement between two policies of one report, named by their
    labels (``snapkv(budget=1024)``) or specs (``snapkv:budget=1024``); both scored the same
    reference tokens."""
    a, b = _report_label(report, a), _report_label(report, b)
    agree_a = per_trajectory(report.turns[a], lambda r: r.top1_agree)
    agree_b = per_trajectory(report.turns[b], lambda r: r.top1_agree)
    tokens = per_trajectory(report.turns[a], lambda r: r.target_tokens)
    ids = [t for t in report.traces if t in agree_a and t in agree_b]
    if not ids:
        raise ValueError(f"{a!r} and {b!r} share no trajectory")
    estimate, lo, hi = paired_difference_ci(
        [agree_a[t] for t in ids], [agree_b[t] for t in ids], [tokens[t] for t in ids]
    )
    return PairedComparison(a, b, len(ids), estimate, (lo, hi))


def _report_label(report: ReplayReport, name: str) -> str:
    if name in report.turns:
        return name
    try:
        label = parse_policy_spec(name).describe()
    except ValueError:
        label = None
    if label not in report.turns:
        raise ValueError(f"no policy {name!r} in the report; it has {list(report.turns)}")
    return label
