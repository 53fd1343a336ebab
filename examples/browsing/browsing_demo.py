"""Run the browsing agent on the research tasks, under FullCache and under its per-node policies.

    python examples/browsing/browsing_demo.py                  # `make demo`: starts `agentkv serve`
    python examples/browsing/browsing_demo.py --base-url http://127.0.0.1:30000/v1 --model M

Without ``--base-url`` it starts ``agentkv serve`` (the embedded engine, default model
SmolLM2-135M-Instruct) on a free port of 127.0.0.1 and stops it at the end. Every model call
goes over HTTP with the node's policy; the server's telemetry (``usage.agentkv``, read with
``agentkv.usage``) fills a per-node table and a plot of live KV per model call.
Writes ``results.json``, ``table.md`` and ``live_kv.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
from browsing_agent import DEFAULT_POLICY, NODE_POLICIES, build_agent, turn_input
from langchain_core.callbacks import BaseCallbackHandler
from langchain_openai import ChatOpenAI
from research_tasks import TASKS, ResearchTask, task_by_name
from wiki_corpus import WikiCorpus, make_tools

import agentkv
from agentkv import FullCache, GraphPolicy

#: The two configurations the demo compares: label -> graph policy.
CONFIGS: dict[str, GraphPolicy] = {
    "FullCache": GraphPolicy(default=FullCache()),
    "per-node": GraphPolicy(default=DEFAULT_POLICY, nodes=NODE_POLICIES),
}
NODES = ("plan", "browse", "answer")


@dataclass
class CallRecord:
    """One model call: where it was made and the server's telemetry for it."""

    config: str
    task: str
    turn: int
    index: int  # call number within the task (0-based)
    node: str
    wall_s: float  # client-side, HTTP included
    kv: dict[str, Any] | None  # usage.agentkv (None: the server sent none)
    reply: str = ""


@dataclass
class TurnResult:
    config: str
    task: str
    turn: int
    question: str
    answer: str
    facts: list[str]
    facts_found: list[str] = field(default_factory=list)


class CallRecorder(BaseCallbackHandler):
    """Records every chat-model call of a run with its node, wall time and KV telemetry, and
    prints one progress line per call."""

    def __init__(self, print_fn: Callable[[str], Any] = print) -> None:
        self.print_fn = print_fn
        self.records: list[CallRecord] = []
        self.where: tuple[str, str, int] = ("", "", 0)  # config, task, turn
        self._open: dict[UUID, tuple[str, float]] = {}

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        node = (metadata or {}).get("langgraph_node") or "-"
        self._open[run_id] = (node, time.perf_counter())

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        node, t0 = self._open.pop(run_id, ("-", time.perf_counter()))
        message = response.generations[0][0].message
        config, task, turn = self.where
        index = sum(1 for r in self.records if (r.config, r.task) == (config, task))
        rec = CallRecord(
            config=config,
            task=task,
            turn=turn,
            index=index,
            node=node,
            wall_s=time.perf_counter() - t0,
            kv=agentkv.usage(message),
            reply=str(message.content or ""),
        )
        self.records.append(rec)
        self.print_fn(progress_line(rec))

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._open.pop(run_id, None)


def progress_line(r: CallRecord) -> str:
    head = f"  [{r.config}] {r.task} turn {r.turn + 1} call {r.index + 1:>2} {r.node:<6}"
    if r.kv is None:
        return f"{head} {r.wall_s:5.1f} s (no KV telemetry from this server)"
    kv = r.kv
    return (
        f"{head} {kv['policy']:<22} prompt {kv['prompt_tokens']:>5} "
        f"(hit {kv['prefix_hit_tokens']:>5})  live KV {kv['live_kv_tokens']:>7.0f}  "
        f"evicted {kv['evicted_tokens']:>4}  {r.wall_s:5.1f} s"
    )


# ----------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def agentkv_server(
    model: str | None = None,
    device: str | None = None,
    kv_slots: int = 16384,
    log_path: Path | None = None,
    timeout_s: float = 300.0,
) -> Iterator[str]:
    """``agentkv serve`` on a free port of 127.0.0.1, in a child process; yields its base URL
    (``http://127.0.0.1:PORT/v1``) once ``/health`` answers, and stops it on exit."""
    exe = shutil.which("agentkv", path=str(Path(sys.executable).parent)) or shutil.which("agentkv")
    if exe is None:
        raise SystemExit("`agentkv` is not installed here: run `make setup` (or pip install -e .)")
    port = _free_port()
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--kv-slots", str(kv_slots)]
    cmd += ["--model", model] if model else []
    cmd += ["--device", device] if device else []
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"agentkv serve exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"agentkv serve did not answer in {timeout_s:.0f} s")
            time.sleep(0.5)
        yield base + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log is not subprocess.DEVNULL:
            log.close()


# ------------------------------------------------------------------------------- runs
def run_task(
    app: Any,
    task: ResearchTask,
    config: str,
    recorder: CallRecorder,
    thread_id: str,
    scripted: bool,
) -> list[TurnResult]:
    """All turns of ``task`` on one thread (the turns share their history)."""
    results = []
    for i, turn in enumerate(task.turns):
        recorder.where = (config, task.name, i)
        out = app.invoke(
            turn_input(turn.question, turn.script if scripted else ()),
            {"configurable": {"thread_id": thread_id}, "callbacks": [recorder]},
        )
        answer = str(out["messages"][-1].content or "")
        found = [f for f in turn.facts if f.casefold() in answer.casefold()]
        results.append(
            TurnResult(config, task.name, i, turn.question, answer, list(turn.facts), found)
        )
    return results


def run_demo(
    base_url: str,
    *,
    model: str | None = None,
    api_key: str = "agentkv",
    scripted: bool = True,
    tasks: Sequence[ResearchTask] = TASKS,
    configs: Mapping[str, GraphPolicy] = CONFIGS,
    max_tokens: int = 24,
    corpus: WikiCorpus | None = None,
    end_sessions: bool = True,
    print_fn: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run every task under every configuration against ``base_url``.

    Each (configuration, task) runs on its own thread id (the server's session id) and, on an
    agentkv server, its own ``cache_salt`` per configuration, so no configuration reuses
    another's prefix cache. ``end_sessions``: drop each session from the server after its task.
    Returns ``{"model", "scripted", "records": [CallRecord], "turns": [TurnResult],
    "sessions": [{"config", "task", "thread_id", "cache_salt"}], "configs"}``."""
    caps = agentkv.fetch_capabilities(base_url, api_key=api_key)
    model = model or (caps.model if caps else None) or _first_model(base_url, api_key)
    print_fn(
        "mode: SCRIPTED - each turn's tool calls come from the task's script; every model "
        "call still goes to the server"
        if scripted
        else "mode: MODEL - the model picks the tools (LangChain tool calling)"
    )
    print_fn(
        f"server: {base_url}, model {model}"
        + ("" if caps else " (not an agentkv server: no KV telemetry)")
    )
    corpus = corpus or WikiCorpus.load()
    tools = make_tools(corpus)
    recorder = CallRecorder(print_fn)
    turns: list[TurnResult] = []
    sessions: list[dict[str, Any]] = []
    run_id = uuid.uuid4().hex[:8]
    for label, policy in configs.items():
        salt = f"browsing-{run_id}-{label}" if caps else None
        extra = {"cache_salt": salt} if salt else None
        llm = ChatOpenAI(
            base_url=base_url,
            api_key=api_key,
            model=model,
            max_tokens=max_tokens,
            temperature=0,
            max_retries=0,
            timeout=600,
            extra_body=extra,
        )
        app = build_agent(llm, tools, scripted=scripted, default=policy.default, nodes=policy.nodes)
        print_fn(f"{label}: {describe(policy)}")
        for task in tasks:
            thread_id = f"browsing-{label}-{task.name}-{run_id}"
            turns += run_task(app, task, label, recorder, thread_id, scripted)
            sessions.append(
                {"config": label, "task": task.name, "thread_id": thread_id, "cache_salt": salt}
            )
            if caps and end_sessions:  # the session's KV is no longer needed
                with contextlib.suppress(httpx.HTTPError):
                    httpx.delete(
                        f"{base_url.removesuffix('/v1')}/v1/agentkv/sessions/{thread_id}",
                        params={"cache_salt": salt},
                        headers={"Authorization": f"Bearer {api_key}"},
                        timeout=30,
                    )
    return {
        "model": model,
        "scripted": scripted,
        "records": recorder.records,
        "turns": turns,
        "sessions": sessions,
        "configs": dict(configs),
    }


def _first_model(base_url: str, api_key: str) -> str:
    r = httpx.get(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"})
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def describe(policy: GraphPolicy) -> str:
    nodes = ", ".join(f"{n}={p.describe()}" for n, p in policy.nodes.items())
    return f"default {policy.default.describe()}" + (f"; {nodes}" if nodes else "")


# ------------------------------------------------------------------------------ table
def node_rows(records: Sequence[CallRecord]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{config: {node or "ALL": row}}``: calls, peak live / resident KV, evicted,
    quantized, prefix hits and wall time over the calls of that node."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        for node in (r.node, "ALL"):
            row = out.setdefault(r.config, {}).setdefault(
                node,
                {
                    "calls": 0,
                    "policies": [],
                    "peak_live_kv_tokens": 0.0,
                    "peak_resident_kv_bytes": 0,
                    "evicted_tokens": 0,
                    "quantized_entries": 0,
                    "prompt_tokens": 0,
                    "prefix_hit_tokens": 0,
                    "wall_s": 0.0,
                    "telemetry": True,
                },
            )
            row["calls"] += 1
            row["wall_s"] += r.wall_s
            if r.kv is None:
                row["telemetry"] = False
                continue
            if r.kv["policy"] not in row["policies"]:
                row["policies"].append(r.kv["policy"])
            row["peak_live_kv_tokens"] = max(row["peak_live_kv_tokens"], r.kv["live_kv_tokens"])
            row["peak_resident_kv_bytes"] = max(
                row["peak_resident_kv_bytes"], r.kv["resident_kv_bytes"]
            )
            for key in ("evicted_tokens", "quantized_entries", "prompt_tokens"):
                row[key] += r.kv.get(key, 0)
            row["prefix_hit_tokens"] += r.kv["prefix_hit_tokens"]
    return out


def format_table(records: Sequence[CallRecord]) -> str:
    """Markdown: one row per (configuration, node), then the configuration's ALL row."""
    rows = node_rows(records)
    full = rows.get("FullCache", {}).get("ALL")
    lines = [
        "| config | node | policy (server) | calls | peak live KV tokens | peak resident KV MiB "
        "| resident vs FullCache | evicted tokens | quantized cells | prefix-hit rate | wall s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {n: i for i, n in enumerate((*NODES, "ALL"))}
    for config, nodes in rows.items():
        for node in sorted(nodes, key=lambda n: order.get(n, len(order))):
            r = nodes[node]
            if not r["telemetry"]:
                lines.append(
                    f"| {config} | {node} | - | {r['calls']} | - | - | - | - | - | - "
                    f"| {r['wall_s']:.1f} |"
                )
                continue
            ratio = (
                f"{r['peak_resident_kv_bytes'] / full['peak_resident_kv_bytes']:.2f}x"
                if node == "ALL" and full and full["peak_resident_kv_bytes"]
                else ""
            )
            policy = ", ".join(r["policies"]) if node != "ALL" else ""
            hit = r["prefix_hit_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
            lines.append(
                f"| {config} | {node} | {policy} | {r['calls']} | {r['peak_live_kv_tokens']:.0f} "
                f"| {r['peak_resident_kv_bytes'] / 2**20:.1f} | {ratio} | {r['evicted_tokens']} "
                f"| {r['quantized_entries']} | {hit:.2f} | {r['wall_s']:.1f} |"
            )
    return "\n".join(lines)


def format_answers(turns: Sequence[TurnResult]) -> str:
    """Facts of the expected answer found in each configuration's answers (a 135M model
    answers poorly; this shows whether a policy changed what it could quote)."""
    by_config: dict[str, list[int]] = {}
    for t in turns:
        found, total = by_config.setdefault(t.config, [0, 0])
        by_config[t.config] = [found + len(t.facts_found), total + len(t.facts)]
    return "; ".join(f"{c}: {f}/{n} facts in the answers" for c, (f, n) in by_config.items())


# ------------------------------------------------------------------------------- plot
def plot_live_kv(records: Sequence[CallRecord], path: Path, title: str = "") -> Path | None:
    """Live KV tokens (top) and resident KV MiB (bottom) after each model call, one panel
    per task, one line per configuration; dotted lines mark user turns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in records if r.kv is not None]
    if not recs:
        return None
    tasks = list(dict.fromkeys(r.task for r in recs))
    configs = list(dict.fromkeys(r.config for r in recs))
    markers = {"plan": "o", "browse": "s", "answer": "^"}
    fig, axes = plt.subplots(
        2, len(tasks), figsize=(3.6 * len(tasks) + 1, 5.4), squeeze=False, sharey="row"
    )
    for col, task in enumerate(tasks):
        for row, (key, scale, ylabel) in enumerate(
            (
                ("live_kv_tokens", 1, "live KV (tokens)"),
                ("resident_kv_bytes", 2**20, "resident KV (MiB)"),
            )
        ):
            ax = axes[row][col]
            for ci, config in enumerate(configs):
                rs = [r for r in recs if r.task == task and r.config == config]
                xs = [r.index + 1 for r in rs]
                ys = [r.kv[key] / scale for r in rs]
                (line,) = ax.plot(xs, ys, color=f"C{ci}", label=config, lw=1.5)
                for node, m in markers.items():
                    pts = [(x, y) for x, y, r in zip(xs, ys, rs, strict=True) if r.node == node]
                    if pts:
                        ax.scatter(
                            *zip(*pts, strict=True),
                            marker=m,
                            color=line.get_color(),
                            s=18,
                            zorder=3,
                        )
            starts = [
                r.index + 1
                for r in recs
                if r.task == task and r.config == configs[0] and r.node == "plan"
            ]
            for x in starts[1:]:
                ax.axvline(x - 0.5, color="grey", ls=":", lw=0.8)
            if row == 0:
                ax.set_title(task, fontsize=10)
            else:
                ax.set_xlabel("model call (dotted: new user turn)", fontsize=8)
            if col == 0:
                ax.set_ylabel(ylabel, fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for node, m in markers.items():
        handles.append(plt.Line2D([], [], marker=m, color="k", ls="", ms=5))
        labels.append(node)
    fig.legend(handles, labels, loc="upper right", fontsize=8, ncol=len(labels))
    if title:
        fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(
    result: Mapping[str, Any], out: Path, print_fn: Callable[[str], Any] = print
) -> dict[str, Path]:
    """Print the per-node table and the answers' facts; write ``table.md``, ``results.json``
    and ``live_kv.png`` under ``out``. Returns the paths written by name."""
    records, turns = result["records"], result["turns"]
    mode = "scripted" if result["scripted"] else "model picks tools"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(records)
    print_fn("")
    print_fn(table)
    print_fn("")
    print_fn(format_answers(turns))
    paths = {"table": out / "table.md", "results": out / "results.json"}
    paths["table"].write_text(table + "\n", encoding="utf-8")
    paths["results"].write_text(
        json.dumps(
            {
                "model": result["model"],
                "mode": mode,
                "date": stamp,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "configs": {k: v.model_dump(mode="json") for k, v in result["configs"].items()},
                "records": [asdict(r) for r in records],
                "turns": [asdict(t) for t in turns],
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    title = (
        f"browsing agent, {result['model']}, {mode}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {stamp}"
    )
    plot = plot_live_kv(records, out / "live_kv.png", title)
    if plot is not None:
        paths["plot"] = plot
    return paths


# -------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The browsing agent on the research tasks: FullCache vs per-node KV "
        "policies, per-node KV telemetry table and live-KV plot."
    )
    p.add_argument(
        "--base-url",
        help="an OpenAI-compatible endpoint (e.g. http://127.0.0.1:30000/v1); default: start "
        "`agentkv serve` (embedded engine) on 127.0.0.1",
    )
    p.add_argument("--model", help="model name at --base-url, or the local model for agentkv serve")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "agentkv"))
    p.add_argument(
        "--scripted",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tool calls from the tasks' scripts (default: on with the embedded engine, off "
        "with --base-url); --no-scripted lets the model pick the tools",
    )
    p.add_argument(
        "--task",
        action="append",
        choices=[t.name for t in TASKS],
        help="run only these tasks (repeatable; default: all)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="tokens per model call (default: 24 scripted, 256 when the model picks tools)",
    )
    p.add_argument("--device", help="device for agentkv serve (cpu, cuda)")
    p.add_argument("--kv-slots", type=int, default=16384, help="KV pool of agentkv serve")
    p.add_argument("--out", type=Path, default=Path("out/browsing"), help="folder for the results")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    scripted = args.scripted if args.scripted is not None else args.base_url is None
    tasks = [task_by_name(n) for n in args.task] if args.task else list(TASKS)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    print("loading the Wikipedia corpus and its BM25 index ...")
    corpus = WikiCorpus.load()
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            print(f"starting agentkv serve on 127.0.0.1 (log: {args.out / 'server.log'}) ...")
            base_url = stack.enter_context(
                agentkv_server(
                    model=args.model,
                    device=args.device,
                    kv_slots=args.kv_slots,
                    log_path=args.out / "server.log",
                )
            )
        result = run_demo(
            base_url,
            model=args.model if args.base_url else None,
            api_key=args.api_key,
            scripted=scripted,
            tasks=tasks,
            max_tokens=args.max_tokens or (24 if scripted else 256),
            corpus=corpus,
        )
    paths = write_report(result, args.out)
    print(
        f"\nmode: {'SCRIPTED' if scripted else 'MODEL'}; {len(result['records'])} model calls in "
        f"{time.perf_counter() - t0:.0f} s; wrote {', '.join(str(p) for p in paths.values())}"
    )
    return result


if __name__ == "__main__":
    main()
