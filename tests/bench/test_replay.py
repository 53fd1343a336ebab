"""Smoke replay on 2 real (shortened) tau-bench trajectories through the real engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv import FullCache, IntentKV, StreamingLLM
from agentkv.bench.traces import Trace, load_tau_bench

pytestmark = pytest.mark.slow

BUDGETS = {"intentkv": 24, "streamingllm": 96}


def agentkv_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``agentkv bench ...`` in a subprocess (the installed CLI's code path)."""
    return subprocess.run(
        [sys.executable, "-m", "agentkv.engine.cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def agentkv_cli_in_process(*args: str):
    """``agentkv bench ...`` through the same typer app in this process (a ``click`` Result),
    without an interpreter's start-up (torch and transformers: ~7 s); the installed entry
    point runs as a subprocess in :func:`test_cli_replays_a_user_jsonl`."""
    from typer.testing import CliRunner

    from agentkv.engine.cli import app

    return CliRunner().invoke(app, ["bench", *args])


def _short(trace: Trace, n_messages: int = 8) -> Trace:
    """The trajectory's opening, with the 1.3k-token airline policy cut to its first lines and
    no tool schemas, so a CPU replay stays quick; messages are the real ones."""
    msgs = [dict(m) for m in trace.messages[:n_messages]]
    msgs[0]["content"] = msgs[0]["content"][:400]
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    return Trace(id=trace.id, source=trace.source, messages=msgs, tools=None)


#: messages kept per trajectory: system, user, assistant, user, assistant (two turns each,
#: the fewest that has a later turn to hit the prefix cache)
N_MESSAGES = 5


@pytest.fixture(scope="module")
def traces() -> list[Trace]:
    picked = [
        t
        for t in load_tau_bench()
        if sum(m["role"] == "assistant" for m in t.messages[:N_MESSAGES]) >= 2
    ]
    return [_short(t, N_MESSAGES) for t in picked[:2]]


@pytest.fixture(scope="module")
def report(engine, traces):
    import torch

    from agentkv.bench.replay import replay

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        policies = [
            FullCache(),
            IntentKV(budget=BUDGETS["intentkv"]),
            StreamingLLM(budget=BUDGETS["streamingllm"]),
        ]
        return replay(engine, traces, policies, greedy_tokens=4, max_tokens=2048, progress=False)
    finally:
        torch.set_num_threads(threads)


def _summary(report, method):
    return next(s for s in report.summaries if s.policy["method"] == method)


def test_fullcache_replayed_matches_the_reference_exactly(report, traces):
    assert report.traces == [t.id for t in traces]
    full = _summary(report, "full")
    assert full.turns >= 4 and full.tokens > 0
    assert full.top1_agreement == 1.0
    assert full.mean_kl < 1e-6
    assert abs(full.nll_delta) < 1e-5
    assert full.greedy_exact_match == 1.0


def test_confidence_intervals_bracket_the_estimates(report):
    for s in report.summaries:
        assert s.top1_ci95[0] <= s.top1_agreement <= s.top1_ci95[1], s.label
        assert s.greedy_ci95[0] <= s.greedy_exact_match <= s.greedy_ci95[1], s.label
    assert _summary(report, "full").top1_ci95 == (1.0, 1.0)


def test_compare_policies_is_paired_and_names_the_winner(report, tmp_path):
    from agentkv.bench.replay import compare_policies, write_outputs

    full, stream = _summary(report, "full"), _summary(report, "streamingllm")
    c = compare_policies(report, full.label, f"streamingllm:budget={BUDGETS['streamingllm']}")
    assert c.trajectories == len(report.traces)
    assert c.top1_difference == pytest.approx(full.top1_agreement - stream.top1_agreement)
    assert c.ci95[0] <= c.top1_difference <= c.ci95[1]
    same = compare_policies(report, stream.label, stream.label)
    assert (same.top1_difference, same.ci95) == (0.0, (0.0, 0.0))
    assert "no difference" in str(same)
    with pytest.raises(ValueError, match="no policy 'h2o'"):
        compare_policies(report, "h2o", full.label)
    # the CLI reads a results.json
    path = write_outputs(report, tmp_path)["results"]
    res = agentkv_cli_in_process("compare", str(path), "full", "full")
    assert res.exit_code == 0, res.output[-2000:]
    assert "full() - full(): top-1 agreement +0.0000" in res.stdout


def test_evicting_policies_respect_their_budgets(report):
    for method in ("intentkv", "streamingllm"):
        s = _summary(report, method)
        assert s.max_planned_over_budget <= 1e-6, (method, s.max_planned_over_budget)
        for r in report.turns[s.label]:
            # IntentKV's budget is the total live KV unless the forced set alone exceeds it
            bound = BUDGETS[method]
            if method == "intentkv":
                bound = max(bound, r.forced_tokens)
            assert r.planned_live_kv_tokens <= bound + 1e-6
    stream = _summary(report, "streamingllm")
    full = _summary(report, "full")
    # StreamingLLM really compressed, and that costs fidelity: the metrics can tell.
    assert stream.mean_peak_live_kv_tokens < full.mean_peak_live_kv_tokens
    assert stream.effective_kv_reads < stream.raw_kv_reads
    assert stream.mean_kl > 0 and stream.top1_agreement < 1.0


def test_planning_time_is_measured_per_request_and_within_the_request(report):
    for s in report.summaries:
        records = report.turns[s.label]
        assert all(0 < r.plan_time_s < r.wall_time_s for r in records), s.label
        assert s.mean_plan_ms == pytest.approx(
            1000 * sum(r.plan_time_s for r in records) / len(records)
        )


def test_later_turns_hit_the_prefix_cache(report):
    for label, records in report.turns.items():
        by_trace: dict[str, list] = {}
        for r in records:
            by_trace.setdefault(r.trace, []).append(r)
        for trace, rs in by_trace.items():
            rs.sort(key=lambda r: r.turn)
            assert len(rs) >= 2, (label, trace)
            assert all(r.prefix_hit_tokens > 0 for r in rs[1:]), (label, trace)
        s = next(s for s in report.summaries if s.label == label)
        assert 0 < s.prefix_hit_rate_turn2plus <= 1


def test_outputs_are_written(report, tmp_path):
    from agentkv.bench.replay import write_outputs

    paths = write_outputs(report, tmp_path)
    data = json.loads(paths["results"].read_text())
    assert [p["label"] for p in data["policies"]] == [s.label for s in report.summaries]
    assert set(data["turns"]) == {s.label for s in report.summaries}
    summary = paths["summary"].read_text()
    for s in report.summaries:
        assert f"| {s.label} |" in summary
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_of_shards_equals_the_whole(report, tmp_path):
    from agentkv.bench.replay import ReplayReport, merge_results, write_outputs

    parts = []
    for i, trace in enumerate(report.traces):
        part = ReplayReport(
            **{
                **report.__dict__,
                "command": f"agentkv bench replay --shard {i}/2 --out o/{i} --limit 2",
                "traces": [trace],
                "turns": {k: [r for r in v if r.trace == trace] for k, v in report.turns.items()},
            }
        )
        parts.append(write_outputs(part, tmp_path / f"s{i}")["results"])
    merged = merge_results(parts)
    assert merged.command == "agentkv bench replay --limit 2"
    for a, b in zip(merged.summaries, report.summaries, strict=True):
        assert a.label == b.label
        assert a.top1_agreement == pytest.approx(b.top1_agreement)
        assert a.mean_kl == pytest.approx(b.mean_kl)
        assert a.mean_peak_live_kv_tokens == pytest.approx(b.mean_peak_live_kv_tokens)


def test_cli_replays_a_user_jsonl(traces, tmp_path):
    # the opening up to its first assistant turn: one turn per policy is enough for the CLI's
    # path (reading, replaying, writing); turns >= 2 are checked on `report` above
    msgs = traces[0].messages
    first = next(i for i, m in enumerate(msgs) if i > 0 and m["role"] == "assistant")
    src = tmp_path / "traces.jsonl"
    src.write_text(json.dumps({"messages": msgs[: first + 1]}) + "\n")
    out = tmp_path / "out"
    proc = agentkv_cli(
        *["replay", str(src), "--policy", "full", "--policy", "streamingllm:budget=64"],
        *["--greedy-tokens", "2", "--max-tokens", "1500", "--device", "cpu", "--out", str(out)],
        timeout=600,
        OMP_NUM_THREADS="1",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "streamingllm(budget=64)" in proc.stdout
    assert {p.name for p in Path(out).iterdir()} >= {
        "results.json",
        "summary.md",
        "fidelity_vs_memory.png",
    }


def test_cli_exports_a_source_that_replays_as_jsonl(tmp_path):
    from agentkv.bench.replay import load_traces

    out = tmp_path / "tau.jsonl"
    res = agentkv_cli_in_process(
        "export", "--source", "tau-bench", "--limit", "3", "--out", str(out)
    )
    assert res.exit_code == 0, res.output[-2000:]
    assert "wrote 3 trajectories" in res.stderr
    exported = load_traces(out, None, None)
    original = load_traces(None, "tau-bench", 3)
    assert [(t.id, t.messages, t.tools) for t in exported] == [
        (t.id, t.messages, t.tools) for t in original
    ]
    bad = agentkv_cli_in_process("export", "--source", "nope", "--out", str(out))
    assert bad.exit_code == 2 and "unknown trace source 'nope'" in bad.stderr


def test_cli_rejects_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "nope"}\n')
    res = agentkv_cli_in_process("replay", str(bad), "--out", str(tmp_path))
    assert res.exit_code == 2
    assert "bad.jsonl:1" in res.stderr
    short = tmp_path / "short.jsonl"
    msgs = [{"role": "user", "content": "hi " * 40}, {"role": "assistant", "content": "hello"}]
    short.write_text(json.dumps({"messages": msgs}) + "\n")
    args = ("--max-tokens", "16", "--device", "cpu", "--out", str(tmp_path / "o"))
    res = agentkv_cli_in_process("replay", str(short), *args)
    assert res.exit_code == 2, res.output[-2000:]
    assert "none of the 1 has an assistant turn within --max-tokens 16" in res.stderr
    assert not (tmp_path / "o" / "results.json").exists()
