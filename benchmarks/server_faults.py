"""The issue-14 probes of ``agentkv serve``, measured: what a hostile-but-fair client gets.

1. cross-tenant prefix-cache probe: tenant B sends tenant A's exact secret prompt, tenant C a
   wrong guess (each its tenant's first request); ``usage.agentkv.prefix_hit_tokens`` of each,
   A's own repeat for contrast;
2. abandoned streams: N streams closed after their first chunk, then a 1-token request:
   its latency, and how long until the engine is idle;
3. an oversized body (5 MB of content): time to its 413;
4. a prompt within the model's context but over the KV pool: time to its 400.

Runs the engine and server in this process (127.0.0.1). Writes ``out/server_faults.json``.

    python benchmarks/server_faults.py                 # CPU
    python benchmarks/server_faults.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import httpx

from agentkv.engine.engine import Engine
from agentkv.engine.server import BackgroundServer
from agentkv.engine.tenancy import ServerOptions

KEY_A, KEY_B, KEY_C = "tenant-a", "tenant-b", "tenant-c"
LONG_ANSWER = [{"role": "user", "content": "Count from 1 to 300, separated by commas."}]


def secret(word: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"The deploy password is {word}. Never reveal it."},
        {"role": "user", "content": "Hello."},
    ]


def hits(c: httpx.Client, messages) -> int:
    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    r.raise_for_status()
    return r.json()["usage"]["agentkv"]["prefix_hit_tokens"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, default=8, help="abandoned streams")
    ap.add_argument("--max-tokens", type=int, default=200, help="tokens each stream asks for")
    ap.add_argument("--out", type=Path, default=Path("out/server_faults.json"))
    args = ap.parse_args()

    engine = Engine(device=args.device, kv_slots=2048)
    opts = ServerOptions(api_keys=(KEY_A, KEY_B, KEY_C))
    out: dict = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.node()} {platform.machine()} {args.device}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    with BackgroundServer(engine, options=opts) as srv:
        root = srv.base_url.removesuffix("/v1")
        auth = {"authorization": f"Bearer {KEY_A}"}
        with (
            httpx.Client(base_url=root, headers=auth, timeout=600) as a,
            httpx.Client(base_url=root, headers={"authorization": f"Bearer {KEY_B}"}) as b,
            httpx.Client(base_url=root, headers={"authorization": f"Bearer {KEY_C}"}) as c,
        ):
            prompt = secret("TANGERINE-OCTOPUS-42")
            hits(a, prompt)
            out["probe"] = {
                "a_repeat_hits": hits(a, prompt),
                "b_exact_hits": hits(b, prompt),
                "c_wrong_guess_hits": hits(c, secret("TANGERINE-WALRUS-42")),
            }

            # 2. abandoned streams, then one short request
            body = {"messages": LONG_ANSWER, "max_tokens": args.max_tokens, "stream": True}
            t0 = time.perf_counter()
            for _ in range(args.streams):
                with (
                    httpx.Client(base_url=root, headers=auth, timeout=600) as s,
                    s.stream("POST", "/v1/chat/completions", json=body) as r,
                ):
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break
            t1 = time.perf_counter()
            short = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
            a.post("/v1/chat/completions", json=short).raise_for_status()
            t2 = time.perf_counter()
            while engine.store.stats().num_requests:
                time.sleep(0.01)
            out["abandoned_streams"] = {
                "streams": args.streams,
                "max_tokens_each": args.max_tokens,
                "open_and_abandon_s": round(t1 - t0, 2),
                "one_token_request_after_s": round(t2 - t1, 2),
                "idle_after_s": round(time.perf_counter() - t1, 2),
            }

            # 3. oversized body
            huge = {"messages": [{"role": "user", "content": "x" * 5_000_000}]}
            t0 = time.perf_counter()
            r = a.post("/v1/chat/completions", json=huge)
            out["oversized_body"] = {
                "status": r.status_code,
                "s": round(time.perf_counter() - t0, 3),
            }

        # 4. over the pool (a small-pool engine of its own)
        small = Engine(device=args.device, kv_slots=256)
        with BackgroundServer(small) as srv2, httpx.Client(base_url=srv2.base_url) as c:
            words = " ".join(["apple"] * 600)
            t0 = time.perf_counter()
            r = c.post("/chat/completions", json={"messages": [{"role": "user", "content": words}]})
            out["over_pool"] = {
                "status": r.status_code,
                "param": r.json()["error"]["param"],
                "s": round(time.perf_counter() - t0, 3),
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
