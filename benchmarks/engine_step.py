"""The embedded engine's decode step at a model's shape, with random weights (nothing to
download): where a step's time goes once the KV is quantized, and what a cold start costs.

A causal LM is built from the default model's config (SmolLM2-135M, its tokenizer too) at
``--shape`` (``smollm2``; ``8b``: Llama-3-8B's layers, heads and widths; or
``layers,q_heads,kv_heads,head_dim,hidden,intermediate``), random weights, and handed to
``Engine(model, tokenizer=)``. For each decode path (``graphs``: the fused kernels over the
pools, each step replayed from a CUDA graph; ``kernels``: the same kernels launched eagerly;
``dense``: gathered view + SDPA; ``reference``: the kernels' torch reference) and KV
mode (``bf16`` FullCache, ``int4`` / ``int2`` UniformQuant, whose decode-time pages quantize
every 32 steps, ``kvzap``: KVzap pruning every 16 decode steps, from a random linear surrogate
at the shape with threshold 0, so about half of what leaves its window goes), a prompt of
``--prompt`` tokens is decoded for ``--steps`` steps (greedy, or sampled with
``--temperature`` / ``--top-p``, seed 0)
(end of turn ignored) twice in one process: the first long decode pays any kernel compile
its lengths need (``compiled``: new entries in Triton's cache directory), the second is the
steady state. A step's time is the interval between two of the engine's polls of
``GenerationConfig.should_stop`` (one a decode step): ``ms_per_step`` is their mean
(decode-time pages and graph captures included), ``median_step_ms`` a plain step's.
``--fusions all,none`` runs each path with the engine's fused layers on CUDA (its default: the
one-kernel RMSNorm, rotary embedding and gated activation, the stacked q/k/v and gate/up
GEMMs) and with transformers' own; a set may also name some of ``norms``, ``rotary``,
``projections`` joined by ``+`` (``norms+rotary``; file names get ``+``, which some copy
tools refuse: prefer ``all``/``none`` where files are written). ``--overlap on,off`` runs
each with graph steps launched ahead of the token they feed (the engine's default)
and one step at a time. ``--profile MODE`` writes a cProfile of a third decode of that mode beside the JSON,
``--kernel-profile MODE`` a table of its GPU kernels' times (torch.profiler).

    python3 benchmarks/engine_step.py --shape 8b --prompt 8192 --steps 64 --out engine_step.json

Weights are random, so tokens are meaningless and timings are not: a step's work is the
same for any weights of that shape.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SHAPES = {
    "smollm2": None,  # the config as it is
    "8b": (32, 32, 8, 128, 4096, 14336),
}


def build_model(model_dir: Path, shape: str, device: str, dtype: torch.dtype, max_len: int):
    """``(model, tokenizer)``: random weights at ``shape`` on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dims = SHAPES[shape] if shape in SHAPES else tuple(int(x) for x in shape.split(","))
    if dims is not None and len(dims) != 6:
        raise SystemExit(f"--shape: smollm2, 8b or L,Hq,Hkv,D,hidden,intermediate; got {shape}")
    cfg = AutoConfig.from_pretrained(model_dir)
    if dims is not None:
        (
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
        ) = dims
        cfg.tie_word_embeddings = False
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_len)
    torch.manual_seed(0)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return lm, AutoTokenizer.from_pretrained(model_dir)


def random_surrogate_dir(lm) -> str:
    """A folder holding a random linear KVzap surrogate at ``lm``'s shape (zero bias: about
    half the scores fall below a threshold of 0)."""
    from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta

    meta = SurrogateMeta.for_config(lm.config, "random", "linear")
    L, H, D = meta.num_layers, meta.num_kv_heads, meta.hidden_size
    g = torch.Generator().manual_seed(0)
    folder = tempfile.mkdtemp(prefix="kvzap_random_")
    w = torch.randn(L, H, D, generator=g) / D**0.5
    Surrogate(meta, w, torch.zeros(L, H)).save(Path(folder) / "linear.safetensors")
    return folder


def prompt_messages(tokenizer, n_tokens: int) -> list[dict]:
    """One user message of about ``n_tokens`` tokens (the chat template adds a few)."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    ids = tokenizer(" ".join(words[i % 10] for i in range(n_tokens)))["input_ids"]
    text = tokenizer.decode(ids[: max(n_tokens - 40, 1)])
    return [{"role": "user", "content": text}]


def _cache_entries() -> int:
    d = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return len(os.listdir(d)) if d.is_dir() else 0


def run(args) -> list[dict]:
    from agentkv import FullCache, KVzap, UniformQuant, build_payload
    from agentkv.engine.engine import Engine, GenerationConfig
    from agentkv.engine.model_loader import fusion_paths, resolve_model_dir

    switches = fusion_paths()

    def fusion_set(name: str) -> set[str]:
        on = set(switches) if name == "all" else set(name.split("+")) - {"none"}
        if on - set(switches):
            raise SystemExit(f"--fusions: unknown {sorted(on - set(switches))} in {name!r}")
        return on

    for name in args.fusions.split(","):  # (before the model is built)
        fusion_set(name)
    device = args.device
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model_dir = Path(args.model_dir) if args.model_dir else resolve_model_dir(None)
    lm, tok = build_model(model_dir, args.shape, device, dtype, args.prompt + args.steps + 64)
    msgs = prompt_messages(tok, args.prompt)
    policies = {"bf16": FullCache(), "int4": UniformQuant(bits=4), "int2": UniformQuant(bits=2)}
    if "kvzap" in args.modes.split(","):
        sur = random_surrogate_dir(lm)
        policies["kvzap"] = KVzap(threshold=0.0, surrogate="linear", surrogate_path=sur)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sessions = itertools.count()
    rows = []
    runs = [
        (f, o, p)
        for f in args.fusions.split(",")
        for o in args.overlap.split(",")
        for p in args.paths.split(",")
    ]
    for fusions, overlap, path in runs:
        on = fusion_set(fusions)
        for name, switch in switches.items():
            switch.enabled = name in on
        engine = Engine(
            lm,
            tokenizer=tok,
            kv_slots=args.prompt + args.steps + 4096,
            decode_attention="kernels" if path == "graphs" else path,
            cuda_graphs=path == "graphs",
        )
        engine.decode_overlap = overlap == "on"
        for mode in args.modes.split(","):

            def decode(n: int, engine=engine, policy=policies[mode]):
                """``(seconds, result, step_ms)``: ``step_ms`` from the times the engine
                polls ``should_stop`` (before prefill, then once a decode step, before the
                step's sampler waits for the GPU): one step apart, prefill excluded."""
                # (a session of its own each time: nothing reused from the previous decode)
                payload = build_payload(msgs, policy, f"s{next(sessions)}")
                polls: list[float] = []
                gen = GenerationConfig(
                    max_tokens=n,
                    ignore_eos=True,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=0,
                    should_stop=lambda: polls.append(time.perf_counter()) or False,
                )
                sync()
                t = time.perf_counter()
                res = engine.chat(msgs, payload=payload, gen=gen)
                sync()
                steps_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(polls[1:])]
                return time.perf_counter() - t, res, steps_ms

            decode(8)  # (the short lengths' kernels)
            c0 = _cache_entries()
            t1, _, _ = decode(1)
            _, _, cold = decode(args.steps + 1)
            c1 = _cache_entries()
            _, res, warm = decode(args.steps + 1)
            row = {
                "shape": args.shape,
                "device": device,
                "path": path,
                "fusions": fusions,
                "overlap": overlap,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "mode": mode,
                "prompt_tokens": res.usage.prompt_tokens,
                "steps": len(warm),
                "ms_per_step": statistics.fmean(warm),
                "median_step_ms": statistics.median(warm),
                "max_step_ms": max(warm),
                "first_ms_per_step": statistics.fmean(cold),
                "compiled": c1 - c0,
                "compiled_again": _cache_entries() - c1,
                "prefill_s": t1,
                "resident_kv_mib": res.usage.resident_kv_bytes / 2**20,
                "evicted_entries": res.usage.evicted_entries,
                "live_kv_tokens": res.usage.live_kv_tokens,
            }
            if engine.decode_graph is not None:
                g = engine.decode_graph
                row.update(captures=g.captures, replays=g.replays, graph_failed=g.failed)
            if mode == args.kernel_profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kp:
                    decode(args.steps + 1)
                table = kp.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
                out = args.out.with_name(
                    f"{args.out.stem}_{path}_{fusions}_{overlap}_{mode}_kernels.txt"
                )
                out.write_text(table)
                row["kernel_profile"] = out.name
            if mode == args.profile:
                prof = cProfile.Profile()
                prof.enable()
                decode(args.steps + 1)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
                out = args.out.with_name(
                    f"{args.out.stem}_{path}_{fusions}_{overlap}_{mode}_profile.txt"
                )
                out.write_text(s.getvalue())
                row["profile"] = out.name
            print(
                json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
            )
            rows.append(row)
        del engine
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", help="smollm2, 8b or L,Hq,Hkv,D,hidden,inter")
    ap.add_argument(
        "--model-dir", default=None, help="HF dir of config + tokenizer (default model)"
    )
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (about)")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument(
        "--paths",
        default="graphs,kernels,dense" if torch.cuda.is_available() else "kernels,dense",
        help="graphs (CUDA), kernels, dense, reference",
    )
    ap.add_argument("--modes", default="bf16,int4,int2", help="bf16, int4, int2, kvzap")
    ap.add_argument(
        "--fusions",
        default="all",
        help="comma-separated sets: all (the engine's default on CUDA), none, or "
        "norms/rotary/projections joined by +",
    )
    ap.add_argument(
        "--overlap",
        default="on",
        help="on (graph steps launched before their token is read, the engine's "
        "default), off (one step at a time), or on,off",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--profile", default=None, help="a mode to profile (cProfile)")
    ap.add_argument(
        "--kernel-profile",
        default=None,
        help="a mode whose decode's GPU kernels to time (torch.profiler, CUDA)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path("engine_step.json"))  # (no commas)
    args = ap.parse_args()
    rows = run(args)
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
