"""Session 34's engine (host-side sampling) against this session's on the same random
8B/SmolLM2-shape model: a sampled decode's median step (T 0.8, top-p 0.9, seed 0)."""
import itertools, json, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import engine_step  # (build_model / prompt_messages: transformers only)
from agentkv import FullCache, build_payload
from agentkv.engine.engine import Engine, GenerationConfig

shape, prompt = sys.argv[2], int(sys.argv[3])
lm, tok = engine_step.build_model(Path(sys.argv[1]) / ".gpu/smollm2", shape, "cuda", torch.bfloat16, prompt + 256)
msgs = engine_step.prompt_messages(tok, prompt)
eng = Engine(lm, tokenizer=tok, kv_slots=prompt + 4096, decode_attention="kernels", cuda_graphs=True)
sessions = itertools.count()
for temp in (0.0, 0.8):
    res = []
    for _ in range(3):
        polls = []
        gen = GenerationConfig(max_tokens=129, ignore_eos=True, temperature=temp, top_p=0.9, seed=0,
                               should_stop=lambda: polls.append(time.perf_counter()) or False)
        eng.chat(msgs, payload=build_payload(msgs, FullCache(), f"s{next(sessions)}"), gen=gen)
        res.append([(b - a) * 1e3 for a, b in itertools.pairwise(polls[1:])])
    steps = res[-1]
    print(json.dumps({"which": sys.argv[4], "shape": shape, "temperature": temp,
                      "median_step_ms": round(statistics.median(steps), 3), "mean_step_ms": round(statistics.fmean(steps), 3)}))
