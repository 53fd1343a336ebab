"""Prefix-cache reuse lost to Qwen3's template dropping reasoning at a new user turn.

Qwen3's chat template renders an assistant message's ``<think>`` block only for assistant
turns after the latest user query. While the agent loops over tool calls the cached
sequence (prompt + the generated ``<think>...</think>`` + answer) is a prefix of the next
prompt; at the next *user* turn the template re-renders the earlier assistant turns without
their reasoning, so the next prompt diverges from what the engine cached at ``<think>``.

For every request of a session (a prompt ending in a user or tool message) this compares the
token sequence the engine holds after the previous request (its prompt plus the assistant
message it produced, as the template rendered it then) with the new prompt, and reports the
shared prefix. Tokenizer only (no model): sessions are tau-bench airline trajectories with
synthetic reasoning added to every assistant message (``--reasoning-words`` words), so the
numbers measure the template's mechanics, not a model's reasoning lengths.

    python benchmarks/qwen3_reasoning_prefix.py --limit 20 --reasoning-words 60
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

QWEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "qwen3-tokenizer"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def with_reasoning(messages: list[dict], words: int) -> list[dict]:
    out = copy.deepcopy(messages)
    for k, m in enumerate(out):
        if m["role"] == "assistant":
            m["reasoning_content"] = " ".join(f"step{k}-{w}" for w in range(words))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=20, help="tau-bench trajectories")
    ap.add_argument("--reasoning-words", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=16384, help="stop a session past this")
    ap.add_argument("--tokenizer", type=Path, default=QWEN_DIR)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from agentkv.bench.traces import load_tau_bench, sample
    from agentkv.engine.chat_template import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(args.tokenizer))
    rows = {"user": [0, 0, 0, 0], "tool": [0, 0, 0, 0]}  # requests, cached, shared, prompt
    for trace in sample(load_tau_bench(), limit=args.limit, seed=0):
        msgs = with_reasoning(trace.messages, args.reasoning_words)
        prev_cached: list[int] | None = None
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or i == 0:
                continue
            prompt = renderer.encode(msgs[:i], trace.tools).token_ids
            if len(prompt) > args.max_tokens:
                break
            if prev_cached is not None:
                kind = "user" if msgs[i - 1]["role"] == "user" else "tool"
                r = rows[kind]
                r[0] += 1
                r[1] += len(prev_cached)
                r[2] += common_prefix(prev_cached, prompt)
                r[3] += len(prompt)
            # what the engine holds after this request: the prompt + the generated message
            prev_cached = renderer.encode(
                msgs[: i + 1], trace.tools, add_generation_prompt=False
            ).token_ids
    print(
        f"Qwen3 template, {args.limit} tau-bench trajectories, {args.reasoning_words} reasoning "
        "words per assistant message\n"
    )
    print("| next request after | requests | cached tokens | reused (shared prefix) | lost |")
    print("|---|---:|---:|---:|---:|")
    for kind, (n, cached, shared, _prompt) in rows.items():
        if n:
            lost = cached - shared
            print(
                f"| a {kind} message | {n} | {cached} | {shared} ({shared / cached:.1%}) "
                f"| {lost} ({lost / cached:.1%}) |"
            )


if __name__ == "__main__":
    main()
