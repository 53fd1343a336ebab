"""Run the computer-use agent end to end and print its per-node KV table.

``python -m examples.computer_use`` (``make computer-use``): starts the embedded engine on
127.0.0.1 (or uses ``--base-url``), the shop, a headless Chromium, runs the task through the
LangGraph agent wrapped with per-node KV policies, then prints one row per node from the
server's telemetry (calls, peak live / resident KV, evicted, quantized, prefix hits, wall
time, image parts the text-only model dropped) and what the screenshots would cost in KV
with a VLM (Gemma 3's 256 tokens per image, from the token tagger's counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import convert_to_openai_messages
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

import agentkv
from agentkv import FullCache, IntentKV, UniformQuant
from agentkv.integrations.langgraph import KVUsageCallbackHandler, with_kv_policy

from .agent import DEMO_TASK, SHORT_TASK, Turn, build_graph, instruction
from .browser import Browser, BrowserMissing
from .vlm_cost import FETCH_HINT, CallCost, load_gemma3_tokenizer, screenshot_cost
from .web_app import ShopServer

DEFAULT_POLICIES: dict[str, Any] = {"act": IntentKV(budget=512), "report": UniformQuant(bits=4)}
#: screenshots make big requests: the example's own server takes up to this many bytes
MAX_REQUEST_BYTES = 64 << 20


class CallRecorder(BaseCallbackHandler):
    """Keeps each model call's messages (OpenAI format) and tools, with its graph node."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = []

    def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs) -> None:
        node = (metadata or {}).get("langgraph_node", "-")
        tools = (kwargs.get("invocation_params") or {}).get("tools")
        self.calls.append((node, convert_to_openai_messages(messages[0]), tools))


@dataclass
class RunReport:
    mode: str  # "scripted" or "model-driven"
    session_id: str
    policies: dict[str, str]
    requests: list[dict[str, Any]]  # usage.agentkv of every model call, in order
    session: dict[str, Any]  # GET /v1/agentkv/sessions/{id} (server-side aggregate)
    calls: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]]
    cart: dict[int, int]
    orders: list[dict[str, str]]
    wall_time_s: float
    chromium: str
    answers: list[str] = field(default_factory=list)
    vlm: list[CallCost] | None = None

    def rows(self) -> dict[str, dict[str, Any]]:
        """One row per node from the requests' server telemetry."""
        rows: dict[str, dict[str, Any]] = {}
        for u in self.requests:
            r = rows.setdefault(
                u.get("node") or "-",
                {
                    "policy": u["policy"],
                    "calls": 0,
                    "peak_prompt": 0,
                    "peak_live": 0.0,
                    "peak_resident_bytes": 0,
                    "evicted": 0,
                    "quantized": 0,
                    "prefix_hits": 0,
                    "prompt": 0,
                    "wall_s": 0.0,
                    "dropped_images": 0,
                },
            )
            r["calls"] += 1
            r["peak_prompt"] = max(r["peak_prompt"], u["prompt_tokens"])
            r["peak_live"] = max(r["peak_live"], u["live_kv_tokens"])
            r["peak_resident_bytes"] = max(r["peak_resident_bytes"], u["resident_kv_bytes"])
            r["evicted"] += u["evicted_tokens"]
            r["quantized"] += u.get("quantized_entries", 0)
            r["prefix_hits"] += u["prefix_hit_tokens"]
            r["prompt"] += u["prompt_tokens"]
            r["wall_s"] += u["wall_time_s"]
            r["dropped_images"] += u.get("dropped_image_parts", 0)
        return rows


def _policy_label(p: Any) -> str:
    return p if isinstance(p, str) else p.describe()


def run_computer_use(
    task: Sequence[Turn] = DEMO_TASK,
    base_url: str | None = None,
    model: str = "smollm2",
    scripted: bool = True,
    policies: Mapping[str, Any] | None = None,
    max_tokens: int = 16,
    api_key: str = "x",
    device: str | None = None,
    vlm_cost: bool = True,
    progress: bool = True,
) -> RunReport:
    """Run ``task`` with the agent; ``base_url`` None: an embedded engine on 127.0.0.1."""
    policies = dict(DEFAULT_POLICIES if policies is None else policies)
    mode = "scripted" if scripted else "model-driven"
    sid = f"computer-use-{uuid.uuid4().hex[:8]}"
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    with ExitStack() as stack:
        if base_url is None:
            from agentkv.engine.engine import Engine
            from agentkv.engine.server import BackgroundServer
            from agentkv.engine.tenancy import ServerOptions

            say("loading the default model into the embedded engine ...")
            engine = Engine(device=device, kv_slots=16384)
            opts = ServerOptions(max_request_bytes=MAX_REQUEST_BYTES)
            base_url = stack.enter_context(BackgroundServer(engine, options=opts)).base_url
        shop = stack.enter_context(ShopServer())
        browser = stack.enter_context(Browser())
        chromium = browser.version
        say(f"[{mode}] Chromium {chromium} on {shop.url}; agentkv server {base_url}")
        llm = ChatOpenAI(
            model=model,
            base_url=base_url,
            api_key=api_key,
            max_tokens=max_tokens,
            temperature=0,
            max_retries=0,
            timeout=600,
        )
        n = {"calls": 0}

        def on_call(node: str, reply: Any, seconds: float) -> None:
            n["calls"] += 1
            u = agentkv.usage(reply) or {}
            say(
                f"[{mode}] call {n['calls']:>2} {node:<6} prompt {u.get('prompt_tokens', 0):>5} "
                f"tok, live KV {u.get('live_kv_tokens', 0):>7.1f}, dropped images "
                f"{u.get('dropped_image_parts', 0)}, {seconds:.1f}s"
            )

        graph = build_graph(llm, browser, task if scripted else None, on_call=on_call)
        app = with_kv_policy(
            graph, default=FullCache(), nodes=policies, checkpointer=InMemorySaver()
        )
        usage, recorder = KVUsageCallbackHandler(), CallRecorder()
        config = {
            "configurable": {"thread_id": sid},
            "callbacks": [usage, recorder],
            "recursion_limit": 100,
        }
        t0 = time.perf_counter()
        browser.goto(shop.url)
        answers = []
        for k, turn in enumerate(task):
            say(f"[{mode}] turn {k + 1}/{len(task)}: {turn.instruction}")
            out = app.invoke({"messages": [instruction(turn, browser.observe().text())]}, config)
            answers.append(str(out["messages"][-1].content))
        wall = time.perf_counter() - t0
        root = base_url.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"}
        r = httpx.get(f"{root}/v1/agentkv/sessions/{sid}", headers=headers, timeout=30)
        session = r.json() if r.status_code == 200 else {}
        report = RunReport(
            mode=mode,
            session_id=sid,
            policies={"(default)": "full", **{k: _policy_label(v) for k, v in policies.items()}},
            requests=list(usage.requests),
            session=session,
            calls=recorder.calls,
            cart=dict(shop.state.cart),
            orders=list(shop.state.orders),
            wall_time_s=round(wall, 2),
            chromium=chromium,
            answers=answers,
        )
    if vlm_cost:
        tok = load_gemma3_tokenizer()
        if tok is None:
            say(
                f"VLM screenshot cost skipped: Gemma 3 tokenizer not found; fetch it with: "
                f"{FETCH_HINT}"
            )
        else:
            report.vlm = screenshot_cost(report.calls, tok)
    return report


def format_report(report: RunReport) -> str:
    """The per-node table and the VLM screenshot cost, as markdown."""
    how = (
        "the tools follow a fixed plan; every model call goes through the engine"
        if report.mode == "scripted"
        else "the model picks the tools"
    )
    lines = [
        f"mode: **{report.mode}** ({how}); "
        f"session `{report.session_id}`; {len(report.requests)} model calls; "
        f"wall time {report.wall_time_s:.1f} s; Chromium {report.chromium}",
        "",
        "| node | policy | calls | peak prompt (tok) | peak live KV (tok) | peak resident KV "
        "(KiB) | evicted (tok) | quantized (cells) | prefix hits (tok, rate) | wall (s) | "
        "images dropped |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for node, r in report.rows().items():
        rate = r["prefix_hits"] / r["prompt"] if r["prompt"] else 0.0
        lines.append(
            f"| {node} | {r['policy']} | {r['calls']} | {r['peak_prompt']} | "
            f"{r['peak_live']:.1f} | {r['peak_resident_bytes'] / 1024:.0f} | {r['evicted']} | "
            f"{r['quantized']} | {r['prefix_hits']} ({rate:.2f}) | {r['wall_s']:.1f} | "
            f"{r['dropped_images']} |"
        )
    by_node = report.session.get("by_node", {})
    if by_node:
        seen = ", ".join(
            f"{k}: {v['requests']} calls, {'/'.join(v['policies'])}" for k, v in by_node.items()
        )
        lines += ["", f"server session telemetry (GET /v1/agentkv/sessions): {seen}"]
    if report.vlm:
        last = max(report.vlm, key=lambda c: c.tokens)
        text_tokens = next(
            (
                u["prompt_tokens"]
                for u, c in zip(report.requests, report.vlm, strict=False)
                if c is last
            ),
            None,
        )
        total_img = sum(c.image_tokens for c in report.vlm)
        b = last.image_tokens_by_bucket
        lines += [
            "",
            "Screenshots with a VLM shape (Gemma 3 tokenizer, 256 image tokens + "
            "<start_of_image>/<end_of_image> per screenshot, tagged by agentkv's token tagger):",
            "",
            "| | screenshots | prompt tokens | of which image (obs/image) | current | turn_m1 "
            "| turn_m2 | older |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| largest call ({last.node}) | {last.images} | {last.tokens} | "
            f"{last.image_tokens} | {b['current']} | {b['turn_m1']} | {b['turn_m2']} | "
            f"{b['older']} |",
            "",
            f"The text-only engine saw {text_tokens} prompt tokens for that call (screenshots "
            f"dropped); over all {len(report.vlm)} calls a VLM would prefill {total_img} image "
            "tokens without prefix reuse.",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m examples.computer_use",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--base-url", help="an OpenAI-compatible endpoint (default: embedded engine)")
    ap.add_argument("--model", default="smollm2", help="model name sent to --base-url")
    ap.add_argument("--api-key", default="x")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--scripted",
        dest="scripted",
        action="store_true",
        default=None,
        help="tools follow a fixed plan (default with the embedded tiny model)",
    )
    mode.add_argument(
        "--model-driven",
        dest="scripted",
        action="store_false",
        help="the model picks the tools (needs a capable --base-url model)",
    )
    ap.add_argument("--short", action="store_true", help="the 2-turn task (what CI runs)")
    ap.add_argument("--act-policy", default="intentkv:budget=512")
    ap.add_argument("--report-policy", default="uniform_quant:bits=4")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="first run the same task with FullCache on every node, for comparison",
    )
    ap.add_argument("--json", help="write the report (rows, requests, VLM cost) to this file")
    args = ap.parse_args(argv)
    scripted = args.scripted if args.scripted is not None else args.base_url is None
    runs = [("FullCache on every node", {})] if args.baseline else []
    runs.append(("per-node policies", {"act": args.act_policy, "report": args.report_policy}))
    out = {}
    for title, policies in runs:
        try:
            report = run_computer_use(
                task=SHORT_TASK if args.short else DEMO_TASK,
                base_url=args.base_url,
                model=args.model,
                scripted=scripted,
                policies=policies,
                max_tokens=args.max_tokens,
                api_key=args.api_key,
                device=args.device,
                vlm_cost=title == runs[-1][0],
            )
        except BrowserMissing as e:
            print(f"computer-use: {e}", file=sys.stderr)
            return 2
        print(f"\n### {title}\n\n{format_report(report)}")
        print(f"\ncart after the run: {report.cart}; orders: {report.orders}")
        out[title] = {
            "mode": report.mode,
            "policies": report.policies,
            "rows": report.rows(),
            "requests": report.requests,
            "vlm": [c.__dict__ for c in report.vlm or []],
            "wall_time_s": report.wall_time_s,
            "chromium": report.chromium,
            "orders": report.orders,
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
