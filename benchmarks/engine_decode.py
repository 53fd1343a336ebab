"""The embedded engine's decode speed with bf16 vs INT4 vs INT2 KV on real agent contexts.

For each trajectory (the replay's deterministic sample, truncated like the replay), the
prompt is the conversation before its last assistant message; the engine then decodes
``--decode-tokens`` tokens (greedy, end-of-turn ignored) under FullCache and UniformQuant
(bits 4 and 2), through both decode paths: the fused Triton kernel over the pools
(``kernels``, the CUDA default, its steps replayed from a CUDA graph; ``engine_step.py
--paths graphs,kernels`` compares graphs with eager launches) and the dense
gathered view + SDPA (``dense``). Reported:
decode tokens/s, ratio to FullCache on the same path, resident KV bytes. With ``--profile``,
one decode of each KV mode runs under ``torch.profiler`` and the top operators by device
time are written beside the JSON (where one decode step's time goes).

    python benchmarks/engine_decode.py --device cuda --limit 4 --out out/engine_decode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from agentkv import FullCache, UniformQuant, build_payload
from agentkv.bench.replay import load_traces, truncate
from agentkv.engine.engine import Engine, GenerationConfig

POLICIES = {"bf16": FullCache(), "int4": UniformQuant(bits=4), "int2": UniformQuant(bits=2)}


def prompts(engine: Engine, source: str, limit: int, max_tokens: int):
    for trace in load_traces(None, source, limit):
        msgs = truncate(engine, trace, max_tokens)
        while msgs and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]
        if msgs:
            yield trace.id, msgs, trace.tools


def run_once(engine, msgs, tools, policy, n_tokens, tag):
    payload = build_payload(msgs, policy, f"req:{tag}")
    gen = GenerationConfig(max_tokens=n_tokens, ignore_eos=True)
    res = engine.chat(msgs, tools, payload=payload, gen=gen)
    return res.usage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="tau-bench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    ap.add_argument("--paths", default="kernels,dense")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("out/engine_decode.json"))
    args = ap.parse_args()

    engine = Engine(device=args.device)
    rows = []
    items = list(prompts(engine, args.source, args.limit, args.max_tokens))
    for path in args.paths.split(","):
        engine.decode_attention = path
        for tid, msgs, tools in items:
            run_once(engine, msgs, tools, FullCache(), 4, "warmup")  # compile / warm caches
            for kv, policy in POLICIES.items():
                u = run_once(engine, msgs, tools, policy, args.decode_tokens, f"{tid}-{kv}")
                rows.append(
                    {
                        "path": path,
                        "trace": tid,
                        "kv": kv,
                        "prompt_tokens": u.prompt_tokens,
                        "decode_tokens": u.completion_tokens,
                        "decode_s": u.decode_time_s,
                        "tokens_per_s": u.completion_tokens / max(u.decode_time_s, 1e-9),
                        "prefill_s": u.prefill_time_s,
                        "resident_kv_bytes": u.resident_kv_bytes,
                        "live_kv_bytes": u.live_kv_bytes,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    summary = []
    for path in args.paths.split(","):
        base = None
        for kv in POLICIES:
            rs = [r for r in rows if r["path"] == path and r["kv"] == kv]
            tps = statistics.mean(r["tokens_per_s"] for r in rs)
            base = base or tps
            summary.append(
                {
                    "path": path,
                    "kv": kv,
                    "tokens_per_s": round(tps, 1),
                    "vs_bf16": round(tps / base, 3),
                    "mean_prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in rs)),
                    "resident_kv_mib": round(
                        statistics.mean(r["resident_kv_bytes"] for r in rs) / 2**20, 2
                    ),
                    "live_kv_mib": round(
                        statistics.mean(r["live_kv_bytes"] for r in rs) / 2**20, 2
                    ),
                }
            )
    profile = {}
    if args.profile and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        engine.decode_attention = "kernels"
        tid, msgs, tools = items[0]
        for kv, policy in POLICIES.items():
            run_once(engine, msgs, tools, policy, 8, "warm")
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                u = run_once(engine, msgs, tools, policy, 16, f"prof-{kv}")
                wall = time.perf_counter() - t0
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
            profile[kv] = {"decode_s_16_steps": u.decode_time_s, "wall_s": wall, "top_ops": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": engine.model_name,
        "command": "python benchmarks/engine_decode.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "profile")
        + (" --profile" if args.profile else ""),
    }
    args.out.write_text(json.dumps({**meta, "summary": summary, "rows": rows}, indent=1))
    for kv, p in profile.items():
        args.out.with_name(f"profile_{kv}.txt").write_text(
            f"{kv}: 16 decode steps {p['decode_s_16_steps']:.4f} s (wall {p['wall_s']:.3f} s)\n"
            + p["top_ops"]
        )
    print(
        "| path | KV | decode tokens/s | vs bf16 | prompt tokens | resident KV MiB | live KV MiB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for s in summary:
        print(
            f"| {s['path']} | {s['kv']} | {s['tokens_per_s']} | {s['vs_bf16']:.2f}x "
            f"| {s['mean_prompt_tokens']} | {s['resident_kv_mib']} | {s['live_kv_mib']} |"
        )


if __name__ == "__main__":
    main()
