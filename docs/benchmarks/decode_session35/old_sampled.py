"""Session 34's engine (host-side sampling) against this session's on the same random
8B/SmolLM2-shape model: a decode's median step, greedy and sampled (T 0.8, top-p 0.9, seed 0).

Run with one package or the other on ``PYTHONPATH``::

    python3 old_sampled.py REPO SHAPE PROMPT LABEL    # e.g. REPO smollm2 4096 new
"""

import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1] + "/benchmarks")
import engine_step  # noqa: E402 (build_model / prompt_messages: transformers only)

from agentkv import FullCache, build_payload  # noqa: E402
from agentkv.engine.engine import Engine, GenerationConfig  # noqa: E402

shape, prompt = sys.argv[2], int(sys.argv[3])
model_dir = Path(sys.argv[1]) / ".gpu/smollm2"
lm, tok = engine_step.build_model(model_dir, shape, "cuda", torch.bfloat16, prompt + 256)
msgs = engine_step.prompt_messages(tok, prompt)
eng = Engine(
    lm, tokenizer=tok, kv_slots=prompt + 4096, decode_attention="kernels", cuda_graphs=True
)
sessions = itertools.count()
for temp in (0.0, 0.8):
    for _ in range(3):  # (the last decode is reported: compiles and captures are behind it)
        polls: list[float] = []
        gen = GenerationConfig(
            max_tokens=129,
            ignore_eos=True,
            temperature=temp,
            top_p=0.9,
            seed=0,
            should_stop=lambda p=polls: p.append(time.perf_counter()) or False,
        )
        eng.chat(msgs, payload=build_payload(msgs, FullCache(), f"s{next(sessions)}"), gen=gen)
    steps = [(b - a) * 1e3 for a, b in itertools.pairwise(polls[1:])]
    row = {
        "which": sys.argv[4],
        "shape": shape,
        "temperature": temp,
        "median_step_ms": round(statistics.median(steps), 3),
        "mean_step_ms": round(statistics.fmean(steps), 3),
    }
    print(json.dumps(row))
