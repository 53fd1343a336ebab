"""``sglang_plugin.py capacity --bisect``: the bisection between the last holding and the first
failing level, and ``--criterion`` (what holds means) on a server log's figures (no server:
``holds`` is a threshold or a log excerpt here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sglang_plugin import CRITERIA, bisect_capacity, level_holds, log_stats  # noqa: E402


def test_bisection_finds_the_threshold_with_few_runs():
    runs: list[int] = []

    def holds(level: int) -> bool:
        runs.append(level)
        return level <= 203

    assert bisect_capacity(192, 256, holds) == (203, 204)
    assert len(runs) == 6  # log2(64)
    assert all(192 < x < 256 for x in runs)


def test_adjacent_levels_run_nothing():
    assert bisect_capacity(48, 49, lambda level: 1 / 0) == (48, 49)


def test_from_zero_when_no_level_held():
    assert bisect_capacity(0, 16, lambda level: level <= 5) == (5, 6)


# ---- what "holds" means (--criterion) --------------------------------------------------------


def test_no_queue_is_no_retraction_and_nothing_queued():
    kw = dict(retractions=0, peak_running=96, peak_queue=23)
    assert level_holds("no-retraction", 96, **kw)
    assert not level_holds("no-queue", 96, **kw)
    assert level_holds("no-queue", 64, retractions=0, peak_running=64, peak_queue=0)
    for c in CRITERIA:  # a retraction, a failed request, or sessions never all at once: fail
        assert not level_holds(c, 54, retractions=1, peak_running=54, peak_queue=0)
        assert not level_holds(c, 64, retractions=0, peak_running=64, peak_queue=0, errors=1)
        assert not level_holds(c, 64, retractions=0, peak_running=63, peak_queue=0)
    with pytest.raises(ValueError):
        level_holds("no-oom", 1, retractions=0, peak_running=1, peak_queue=0)


# Session 8's H100 server log (plugin, IntentKV-512, L = 96, turn 4): 73 running, 23 queued
SESSION8_L96 = """\
[2026-11-23 18:45:58] Prefill batch, #new-seq: 15, #new-token: 3506, #cached-token: 22395, \
token usage: 0.71, #running-req: 41, #queue-req: 2, #pending-token: 0, cuda graph: True, \
input throughput (token/s): 8165.74
[2026-11-23 18:45:58] Prefill batch, #new-seq: 17, #new-token: 7633, #cached-token: 23576, \
token usage: 0.71, #running-req: 56, #queue-req: 23, #pending-token: 4060, cuda graph: True, \
input throughput (token/s): 260841.85
[2026-11-23 18:45:58] Decode batch, #running-req: 96, #token: 23956, token usage: 0.73, \
cuda graph: True, gen throughput (token/s): 1350.61, #queue-req: 23
"""


def test_the_criteria_on_a_server_log(tmp_path):
    log = tmp_path / "plugin.log"
    log.write_text(SESSION8_L96)
    s = log_stats(str(log))
    assert s["peak_queue_req"] == 23 and s["retractions"] == 0 and s["peak_running_req"] == 96
    kw = dict(retractions=s["retractions"], peak_running=s["peak_running_req"], peak_queue=23)
    assert level_holds("no-retraction", 96, **kw) and not level_holds("no-queue", 96, **kw)


def test_bisection_under_each_criterion():
    # as Session 8 measured IntentKV-512: queueing from ~96 on, retraction from 272 on
    def row(level: int) -> dict:
        return dict(
            retractions=int(level >= 272), peak_running=level, peak_queue=max(0, level - 80)
        )

    for crit, expect in (("no-queue", (80, 81)), ("no-retraction", (271, 272))):
        assert bisect_capacity(64, 320, lambda n, c=crit: level_holds(c, n, **row(n))) == expect


def test_log_stats_sums_the_plugins_host_time_lines(tmp_path):
    from sglang_plugin import top_host_stages

    log = tmp_path / "plugin.log"
    log.write_text(
        "[2026-11-23 21:00:00] agentkv host time (5.0 s): plan 40.0 ms / 10 = 4.00 ms; "
        "sync 12.5 ms / 5 = 2.50 ms\n"
        "[2026-11-23 21:00:01] Decode batch, #running-req: 2, #token: 90, token usage: 0.01, "
        "#queue-req: 0\n"
        "[2026-11-23 21:00:05] agentkv host time (5.0 s): tag 30.0 ms / 6 = 5.00 ms; "
        "plan 8.0 ms / 2 = 4.00 ms\n"
    )
    host = log_stats(str(log))["agentkv_host_ms"]
    assert host == {
        "plan": {"ms": 48.0, "calls": 12},
        "sync": {"ms": 12.5, "calls": 5},
        "tag": {"ms": 30.0, "calls": 6},
    }
    assert top_host_stages(host, 2) == "host: plan 48 ms, tag 30 ms"
