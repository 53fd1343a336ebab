"""Soak of ``agentkv serve``: 1,000 multi-turn sessions x 8 concurrent, mixed policies,
streamed turns, abandoned streams, ended and left-over sessions, then the admin flush.

Runs the embedded engine and its HTTP server in this process (127.0.0.1, random port) so it
can also check what only the process sees: the store's invariants after the run, its free
slots back at capacity, and the resident set size (RSS) over the run (bounded: the last
sample within ``--rss-slack-mb`` of the sample after the first tenth of the sessions).
Writes ``out/soak/results.json``; exits 1 when a criterion fails.

    python benchmarks/soak.py                              # CPU, the full soak (hours on CPU)
    python benchmarks/soak.py --sessions 100 --turns 2     # a quick one
    python benchmarks/soak.py --device cuda --api-key k    # on a GPU, with auth on
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

from agentkv.bench.soak import SoakConfig, SoakReport, run_soak
from agentkv.engine.engine import Engine
from agentkv.engine.server import BackgroundServer
from agentkv.engine.tenancy import ServerOptions


def rss_mb() -> float:
    """Current resident set size in MiB (``/proc``; peak RSS where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--abandon-every", type=int, default=5)
    ap.add_argument("--keep-every", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-slots", type=int, default=16384)
    ap.add_argument("--api-key", default=None, help="serve with this key (and an admin key)")
    ap.add_argument("--rss-slack-mb", type=float, default=256.0)
    ap.add_argument("--out", type=Path, default=Path("out/soak"))
    args = ap.parse_args()

    engine = Engine(device=args.device, kv_slots=args.kv_slots)
    admin = "soak-admin" if args.api_key else None
    options = ServerOptions(api_keys=(args.api_key,) if args.api_key else (), admin_api_key=admin)
    cfg = SoakConfig(
        sessions=args.sessions,
        concurrency=args.concurrency,
        turns=args.turns,
        max_tokens=args.max_tokens,
        abandon_every=args.abandon_every,
        keep_every=args.keep_every,
        api_key=args.api_key,
        admin_api_key=admin,
    )
    rss_start = rss_mb()

    def progress(done: int, report: SoakReport) -> None:
        stats = engine.store.stats()
        sample = {
            "sessions_done": done,
            "t_s": round(time.perf_counter() - t0, 1),
            "rss_mb": round(rss_mb(), 1),
            "free_slots": stats.free_slots,
            "prefix_cache_tokens": stats.prefix_cache_tokens,
            "errors": len(report.errors),
        }
        report.samples.append(sample)
        print(json.dumps(sample), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    with BackgroundServer(engine, options=options) as srv:
        every = max(1, args.sessions // 20)
        report = run_soak(
            srv.base_url.removesuffix("/v1"), cfg, on_progress=progress, progress_every=every
        )
    engine.store.check_invariants()  # raises on a broken refcount / lock / free list
    stats = engine.store.stats()
    baseline = next(
        (s["rss_mb"] for s in report.samples if s["sessions_done"] >= args.sessions // 10),
        rss_start,
    )
    rss_end = rss_mb()
    checks = {
        "no_errors": not report.errors,
        "slots_back_after_flush": report.ok and stats.free_slots == stats.capacity,
        "no_request_left": stats.num_requests == 0,
        "rss_bounded": rss_end - baseline <= args.rss_slack_mb,
    }
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.node()} {platform.machine()} {args.device}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "report": report.to_dict(),
        "rss_mb": {"start": round(rss_start, 1), "baseline": baseline, "end": round(rss_end, 1)},
        "store_after": {"free_slots": stats.free_slots, "capacity": stats.capacity},
        "checks": checks,
        "passed": all(checks.values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("checks", "passed", "rss_mb")}, indent=2))
    print(
        f"{report.requests} requests, {report.abandoned} abandoned streams, "
        f"{report.sessions_ended} sessions ended, {len(report.errors)} errors, "
        f"{report.wall_s} s"
    )
    for e in report.errors[:10]:
        print("error:", e)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
