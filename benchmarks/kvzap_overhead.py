"""KVzap scoring overhead: surrogate time as a percentage of prefill, and per decode step.

Run on a GPU machine (not a test; never gates CI)::

    python benchmarks/kvzap_overhead.py --out docs/benchmarks/kvzap_overhead.json

For each context length ``N`` (default 8192 and 32768) and each shipped surrogate (linear,
MLP), with CUDA events (median of ``--repeats`` runs after a warm-up):

* ``prefill_ms``: the model's forward pass over ``N`` tokens (plain transformers, SDPA,
  bf16, no KV cache kept), the layer inputs captured by forward pre-hooks;
* ``score_ms``: the surrogate over those ``N`` layer inputs, every layer (what KVzap adds to a
  prefill); ``score_pct`` = score / prefill;
* ``decode_ms``: one decode step at context ``N`` (transformers ``DynamicCache``);
  ``score_step_ms``: the surrogate over one position, every layer, one call per layer;
  ``step_pct``;
* ``deferred_step_ms``: what KVzap's observer does per decode step (keeps each layer's input,
  then every ``--decode-interval`` steps scores the kept rows of all layers in one batched
  call), amortised per step; ``deferred_pct``;
* ``score_pad8_ms`` (linear only): the prefill scoring with the ``Hkv`` output rows padded to 8
  (a probe of the GEMM's shape penalty).

The default model is SmolLM2-135M-Instruct (trained on 8k positions; 32k only times the
arithmetic). A model without a shipped surrogate gets random weights of the right shapes
(``--random-surrogate``): the time does not depend on the weights.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
from pathlib import Path

import torch


def cuda_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def deferred_steps(sur, one: dict, n: int, steps: int) -> None:
    """``steps`` decode steps through KVzap's observer (layer inputs kept), then the read that
    scores them all (what a pruning pass does)."""
    from agentkv.methods import ModelShape
    from agentkv.methods.base import ObserveRequest
    from agentkv.methods.kvzap import KVzapScores

    m = sur.meta
    shape = ModelShape(m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim)
    dev = one[0].device
    obs = KVzapScores(sur, ObserveRequest(n + steps, n, torch.zeros(1, dtype=torch.bool), shape))
    for t in range(steps):
        pos = torch.full((1,), n + t, device=dev)
        for i in range(m.num_layers):
            obs.observe_hidden(i, one[i], pos)
    obs._flush()


def surrogates(model, random_weights: bool):
    from agentkv.methods import ModelShape
    from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta, shipped_surrogate

    c = model.config
    hkv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = ModelShape(c.num_hidden_layers, c.num_attention_heads, hkv, hd)
    out = {}
    for kind in ("linear", "mlp"):
        if not random_weights:
            out[kind] = shipped_surrogate(kind, shape)
            continue
        L, D, h = c.num_hidden_layers, c.hidden_size, max(c.hidden_size // 8, 1)
        meta = SurrogateMeta.for_config(c, "random", kind)
        if kind == "linear":
            out[kind] = Surrogate(meta, torch.randn(L, hkv, D), torch.randn(L, hkv))
        else:
            out[kind] = Surrogate(
                meta, torch.randn(L, h, D), torch.randn(L, h), torch.randn(L, hkv, h),
                torch.randn(L, hkv),
            )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: SmolLM2)")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--random-surrogate", action="store_true")
    ap.add_argument("--decode-interval", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/kvzap_overhead.json"))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "run on a CUDA machine"
    from transformers import AutoModelForCausalLM, DynamicCache

    from agentkv.engine.hidden_states import decoder_layers
    from agentkv.engine.model_loader import resolve_model_dir

    path = resolve_model_dir(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).to("cuda").eval()  # fmt: skip
    surs = surrogates(model, args.random_surrogate)
    hidden: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(module, a, kw):
            hidden[i] = (a[0] if a else kw["hidden_states"])[0]

        return hook

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_pre_hook(keep(i), with_kwargs=True)
    L = model.config.num_hidden_layers
    rows = []
    for n in (int(x) for x in args.contexts.split(",")):
        ids = torch.randint(100, 20000, (1, n), device="cuda")
        with torch.inference_mode():
            prefill = cuda_ms(lambda ids=ids: model.model(input_ids=ids, use_cache=False),
                              max(args.repeats // 2, 3))  # fmt: skip
            hs = dict(hidden)
            cache = DynamicCache(config=model.config)
            model.model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
            last = ids[:, -1:]
            pos = torch.tensor([[n - 1]], device="cuda")

            def step(cache=cache, last=last, pos=pos, n=n):
                model.model(input_ids=last, position_ids=pos, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the step: every run decodes at context n

            decode = cuda_ms(step, args.repeats)
            for kind, sur in surs.items():
                score = cuda_ms(lambda sur=sur, hs=hs: [sur.score(i, hs[i]) for i in range(L)],
                                args.repeats)  # fmt: skip
                one = {i: hs[i][-1:] for i in range(L)}
                score_step = cuda_ms(lambda sur=sur, one=one: [sur.score(i, one[i]) for i in range(L)],
                                     args.repeats)  # fmt: skip
                deferred = cuda_ms(lambda sur=sur, one=one, n=n: deferred_steps(sur, one, n, args.decode_interval),
                                   max(args.repeats // 2, 3)) / args.decode_interval  # fmt: skip
                pad8 = None
                if kind == "linear":
                    w, b = sur._weights(hs[0].device, hs[0].dtype)[:2]
                    hkv = w.shape[1]
                    wp = torch.cat([w, w.new_zeros(L, 8 - hkv, w.shape[2])], 1)
                    bp = torch.cat([b, b.new_zeros(L, 8 - hkv)], 1)
                    pad8 = cuda_ms(lambda hs=hs, wp=wp, bp=bp, hkv=hkv: [
                        torch.nn.functional.linear(hs[i], wp[i], bp[i])[:, :hkv].float()
                        for i in range(L)], args.repeats)  # fmt: skip
                rows.append({
                    "context": n, "surrogate": kind, "params": sur.num_params,
                    "prefill_ms": round(prefill, 3), "score_ms": round(score, 3),
                    "score_pct": round(100 * score / prefill, 3),
                    "decode_ms": round(decode, 3), "score_step_ms": round(score_step, 4),
                    "step_pct": round(100 * score_step / decode, 3),
                    "deferred_step_ms": round(deferred, 4),
                    "deferred_pct": round(100 * deferred / decode, 3),
                    "score_pad8_ms": None if pad8 is None else round(pad8, 3),
                })  # fmt: skip
                print(rows[-1], flush=True)
        del hs, cache
        torch.cuda.empty_cache()
    doc = {
        "model": str(args.model or "SmolLM2-135M-Instruct"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("| context | surrogate | prefill ms | score ms | % of prefill | padded-8 ms | decode step ms "
          "| score/step ms | % of step | deferred/step ms | % of step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['surrogate']} | {r['prefill_ms']} | {r['score_ms']} | "
              f"{r['score_pct']} | {r['score_pad8_ms']} | {r['decode_ms']} | {r['score_step_ms']} | "
              f"{r['step_pct']} | {r['deferred_step_ms']} | {r['deferred_pct']} |")  # fmt: skip


if __name__ == "__main__":
    main()
