"""Stock SGLang vs SGLang + the agentkv plugin, on two running servers (GPU machine).

    python benchmarks/sglang_plugin.py check  --stock URL --plugin URL --out DIR
    python benchmarks/sglang_plugin.py replay --stock URL --plugin URL --out DIR \\
        --sessions 64 --concurrency 32 --policies stock,full,streamingllm:budget=512,intentkv:budget=512

``check``: greedy ``/generate`` on the same token ids: FullCache through the plugin (payload
sent) and a request without payload must give stock SGLang's tokens exactly (same dummy
weights, same kernels, same indices); an evicting policy must run and be planned (the plugin
logs one ``agentkv plan`` line per planned request; the shell script counts them).

``replay``: tau-bench trajectories as concurrent agent sessions, turn by turn (each assistant
turn is one chat-completions request on the trajectory's real history, ``max_tokens`` capped),
against each server, one policy after another (the plugin server's cache is flushed between
policies). Reports per run: wall time, requests, output tokens/s, mean time per output token,
prompt tokens, cached (prefix-hit) tokens (``--enable-cache-report``), errors. The server-side
numbers (peak running requests, peak KV token usage, retractions) come from the server logs
(:func:`log_stats`, the shell script passes the logs).

Writes ``DIR/<phase>.json`` and prints a table. Timings go to docs/benchmarks.md with the
command, machine and date; nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agentkv.bench.traces import load_tau_bench
from agentkv.policies import parse_policy
from agentkv.wire import build_payload, encode_payload


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"}


def flush(url: str) -> None:
    try:
        urllib.request.urlopen(
            urllib.request.Request(url + "/flush_cache", method="POST"), timeout=60
        )
    except urllib.error.URLError as e:
        print(f"flush_cache on {url}: {e}", file=sys.stderr)


# ---- check -------------------------------------------------------------------------------


def check(stock: str, plugin: str, n: int, seed: int) -> dict[str, Any]:
    g = random.Random(seed)
    prompts = [[g.randrange(100, 30000) for _ in range(g.randrange(64, 1024))] for _ in range(n)]
    sp = {"max_new_tokens": 32, "temperature": 0}
    full = encode_payload(build_payload([], parse_policy("full"), "check-full"))
    evict = encode_payload(
        build_payload([], parse_policy("streamingllm:budget=32,sinks=4"), "check-ev")
    )
    rows = []
    for i, ids in enumerate(prompts):
        # cold (first sight of the prompt) and warm (prefix cached) on both servers, so each
        # comparison runs the same SGLang code path on both
        a = post(stock + "/generate", {"input_ids": ids, "sampling_params": sp})
        b = post(
            plugin + "/generate",
            {"input_ids": ids, "sampling_params": {**sp, "custom_params": {"agentkv": full}}},
        )
        a2 = post(stock + "/generate", {"input_ids": ids, "sampling_params": sp})
        c = post(plugin + "/generate", {"input_ids": ids, "sampling_params": sp})
        d = post(
            plugin + "/generate",
            {"input_ids": ids, "sampling_params": {**sp, "custom_params": {"agentkv": evict}}},
        )
        rows.append(
            {
                "prompt_tokens": len(ids),
                "full_equal": "output_ids" in a and a.get("output_ids") == b.get("output_ids"),
                "nopayload_equal": "output_ids" in a2
                and a2.get("output_ids") == c.get("output_ids"),
                "evicting_ok": "output_ids" in d,
                "errors": [x["error"] for x in (a, b, a2, c, d) if "error" in x],
            }
        )
        print(f"prompt {i}: {rows[-1]}")
    return {
        "prompts": n,
        "fullcache_identical": sum(r["full_equal"] for r in rows),
        "no_payload_identical": sum(r["nopayload_equal"] for r in rows),
        "evicting_answered": sum(r["evicting_ok"] for r in rows),
        "rows": rows,
    }


# ---- replay ------------------------------------------------------------------------------


def session_requests(trace, policy, session_id: str, max_tokens: int, tools: bool):
    """One chat request per assistant turn: the trajectory's history up to it."""
    msgs = trace.messages
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        history = msgs[:i]
        body = {
            "model": "default",
            "messages": history,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if tools and trace.tools:
            body["tools"] = trace.tools
        if policy is not None:
            payload = build_payload(history, policy, session_id)
            body["custom_params"] = {"agentkv": encode_payload(payload)}
        yield body


def replay(url: str, traces, policy, concurrency: int, max_tokens: int, tools: bool, tag: str):
    lock = threading.Lock()
    stats = {
        "requests": 0,
        "errors": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "output_tokens": 0,
        "latency_s": 0.0,
    }
    errors: list[str] = []

    def run_session(k: int):
        for body in session_requests(traces[k], policy, f"{tag}-{k}", max_tokens, tools):
            t = time.perf_counter()
            r = post(url + "/v1/chat/completions", body)
            dt = time.perf_counter() - t
            with lock:
                stats["requests"] += 1
                if "error" in r or "usage" not in r:
                    stats["errors"] += 1
                    errors.append(str(r.get("error", r))[:200])
                    continue
                u = r["usage"]
                stats["prompt_tokens"] += u.get("prompt_tokens", 0)
                stats["output_tokens"] += u.get("completion_tokens", 0)
                stats["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                ) or 0
                stats["latency_s"] += dt

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run_session, range(len(traces))))
    wall = time.perf_counter() - t0
    out = dict(stats)
    out["wall_s"] = wall
    out["output_tok_per_s"] = stats["output_tokens"] / wall if wall else 0.0
    out["prefix_hit_rate"] = stats["cached_tokens"] / max(1, stats["prompt_tokens"])
    out["mean_s_per_output_token"] = stats["latency_s"] / max(1, stats["output_tokens"])
    out["error_samples"] = errors[:5]
    return out


_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?#token: (\d+).*?token usage: ([\d.]+)")


def log_stats(path: str | None, since: int = 0) -> dict[str, Any]:
    """Peak running requests, peak KV tokens and usage, retractions, agentkv plans: from an
    SGLang server log, reading from byte ``since``."""
    if not path or not Path(path).is_file():
        return {}
    text = Path(path).read_text(errors="replace")[since:]
    dec = [(int(a), int(b), float(c)) for a, b, c in _DECODE.findall(text)]
    return {
        "peak_running_req": max((d[0] for d in dec), default=0),
        "peak_kv_tokens": max((d[1] for d in dec), default=0),
        "peak_token_usage": max((d[2] for d in dec), default=0.0),
        "retractions": len(re.findall(r"[Rr]etract", text)),
        "agentkv_plans": text.count("agentkv plan"),
        "agentkv_evicted": sum(int(x) for x in re.findall(r"agentkv plan .*?evicted (\d+)", text)),
        "log_bytes": len(text),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["check", "replay"])
    ap.add_argument("--stock", required=True)
    ap.add_argument("--plugin", required=True)
    ap.add_argument("--stock-log")
    ap.add_argument("--plugin-log")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tools", action="store_true", help="send the trajectories' tool schemas")
    ap.add_argument(
        "--policies",
        default="stock,full,streamingllm:budget=512,intentkv:budget=512",
        help="runs in order: 'stock' = the stock server without payload, else a policy spec "
        "sent to the plugin server",
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase == "check":
        res = check(a.stock, a.plugin, a.prompts, a.seed)
        res["plugin_log"] = log_stats(a.plugin_log)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    else:
        traces = load_tau_bench(limit=a.sessions, seed=a.seed)
        runs = []
        for spec in a.policies.split(","):
            if spec == "stock":
                name, url, log, spec = "stock", a.stock, a.stock_log, None
            else:
                name, url, log = f"plugin {spec}", a.plugin, a.plugin_log
            flush(url)
            since = Path(log).stat().st_size if log and Path(log).is_file() else 0
            policy = parse_policy(spec) if spec else None
            r = replay(
                url,
                traces,
                policy,
                a.concurrency,
                a.max_tokens,
                a.tools,
                tag=name.replace(" ", "_"),
            )
            r.update(log_stats(log, since))
            r["run"] = name
            runs.append(r)
            print(json.dumps(r))
        res = {
            "sessions": len(traces),
            "concurrency": a.concurrency,
            "max_tokens": a.max_tokens,
            "runs": runs,
        }
        cols = [
            "run",
            "requests",
            "errors",
            "output_tok_per_s",
            "mean_s_per_output_token",
            "prefix_hit_rate",
            "peak_running_req",
            "peak_kv_tokens",
            "retractions",
            "agentkv_evicted",
        ]
        print("| " + " | ".join(cols) + " |")
        for r in runs:
            print(
                "| "
                + " | ".join(
                    f"{r.get(c, ''):.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                    for c in cols
                )
                + " |"
            )
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
