"""Stock SGLang vs SGLang + the agentkv plugin, on two running servers (GPU machine).

    python benchmarks/sglang_plugin.py check  --stock URL --plugin URL --out DIR
    python benchmarks/sglang_plugin.py capacity --stock URL --plugin URL --stock-log F \\
        --plugin-log F --levels 32,64,128 --max-turns 4 --policies stock,intentkv:budget=512 \\
        [--bisect] --out DIR
    python benchmarks/sglang_plugin.py replay --stock URL --plugin URL --out DIR \\
        --sessions 64 --concurrency 32 --policies stock,full,streamingllm:budget=512,intentkv:budget=512

``check``: greedy ``/generate`` on the same token ids: FullCache through the plugin (payload
sent) and a request without payload must give stock SGLang's tokens exactly (same dummy
weights, same kernels, same indices); an evicting policy must run and be planned (the plugin
logs one ``agentkv plan`` line per planned request; the shell script counts them).

``capacity``: max concurrent sessions per policy (``--levels`` ascending, ``--max-turns`` per
session; a level holds under ``--criterion`` (:func:`level_holds`): ``no-queue``, the default,
when nothing was retracted, every session ran at once and no request ever waited in the
server's queue (peak ``#queue-req`` 0 on every logged batch); ``no-retraction`` drops the queue
condition; ``--bisect``: then bisected between the last holding and the first failing level,
to one session), written to ``DIR/capacity.json`` as it goes. ``sglang_capacity_predict.py``
predicts it on the CPU, under the same criteria.

``replay``: tau-bench trajectories as concurrent agent sessions, turn by turn (each assistant
turn is one chat-completions request on the trajectory's real history, ``max_tokens`` capped),
against each server, one policy after another (the plugin server's cache is flushed between
policies). Reports per run: wall time, requests, output tokens/s, mean time per output token,
prompt tokens, cached (prefix-hit) tokens (``--enable-cache-report``), errors. The server-side
numbers (peak running requests, peak KV token usage, retractions) come from the server logs
(:func:`log_stats`, the shell script passes the logs).

Writes ``DIR/<phase>.json`` and prints a table. Timings go to docs/benchmarks.md with the
command, machine and date; nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, TypedDict

from agentkv.bench.traces import load_tau_bench
from agentkv.integrations.sglang.host_time import parse_host_time
from agentkv.policies import parse_policy
from agentkv.wire import build_payload, encode_payload


def post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"}


def flush(url: str) -> None:
    try:
        urllib.request.urlopen(
            urllib.request.Request(url + "/flush_cache", method="POST"), timeout=60
        )
    except urllib.error.URLError as e:
        print(f"flush_cache on {url}: {e}", file=sys.stderr)


# ---- check -------------------------------------------------------------------------------


def check(stock: str, plugin: str, n: int, seed: int) -> dict[str, Any]:
    g = random.Random(seed)
    prompts = [[g.randrange(100, 30000) for _ in range(g.randrange(64, 1024))] for _ in range(n)]
    sp = {"max_new_tokens": 32, "temperature": 0}
    full = encode_payload(build_payload([], parse_policy("full"), "check-full"))
    evict = encode_payload(
        build_payload([], parse_policy("streamingllm:budget=32,sinks=4"), "check-ev")
    )
    rows = []
    for i, ids in enumerate(prompts):
        # cold (first sight of the prompt) and warm (prefix cached) on both servers, so each
        # comparison runs the same SGLang code path on both
        a = post(stock + "/generate", {"input_ids": ids, "sampling_params": sp})
        b = post(
            plugin + "/generate",
            {"input_ids": ids, "sampling_params": {**sp, "custom_params": {"agentkv": full}}},
        )
        a2 = post(stock + "/generate", {"input_ids": ids, "sampling_params": sp})
        c = post(plugin + "/generate", {"input_ids": ids, "sampling_params": sp})
        d = post(
            plugin + "/generate",
            {"input_ids": ids, "sampling_params": {**sp, "custom_params": {"agentkv": evict}}},
        )
        rows.append(
            {
                "prompt_tokens": len(ids),
                "full_equal": "output_ids" in a and a.get("output_ids") == b.get("output_ids"),
                "nopayload_equal": "output_ids" in a2
                and a2.get("output_ids") == c.get("output_ids"),
                "evicting_ok": "output_ids" in d,
                "errors": [x["error"] for x in (a, b, a2, c, d) if "error" in x],
            }
        )
        print(f"prompt {i}: {rows[-1]}")
    return {
        "prompts": n,
        "fullcache_identical": sum(r["full_equal"] for r in rows),
        "no_payload_identical": sum(r["nopayload_equal"] for r in rows),
        "evicting_answered": sum(r["evicting_ok"] for r in rows),
        "rows": rows,
    }


# ---- replay ------------------------------------------------------------------------------


def session_requests(
    trace, policy, session_id: str, max_tokens: int, tools: bool, max_turns: int | None = None
):
    """One chat request per assistant turn: the trajectory's history up to it (the first
    ``max_turns`` turns when given)."""
    msgs = trace.messages
    turns = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i == 0:
            continue
        if max_turns is not None and turns >= max_turns:
            return
        turns += 1
        history = msgs[:i]
        body = {
            "model": "default",
            "messages": history,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if tools and trace.tools:
            body["tools"] = trace.tools
        if policy is not None:
            payload = build_payload(history, policy, session_id)
            body["custom_params"] = {"agentkv": encode_payload(payload)}
        yield body


def replay(
    url: str,
    traces,
    policy,
    concurrency: int,
    max_tokens: int,
    tools: bool,
    tag: str,
    max_turns: int | None = None,
):
    lock = threading.Lock()
    stats = {
        "requests": 0,
        "errors": 0,
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "output_tokens": 0,
        "latency_s": 0.0,
    }
    errors: list[str] = []

    def run_session(k: int):
        for body in session_requests(traces[k], policy, f"{tag}-{k}", max_tokens, tools, max_turns):
            t = time.perf_counter()
            r = post(url + "/v1/chat/completions", body)
            dt = time.perf_counter() - t
            with lock:
                stats["requests"] += 1
                if "error" in r or "usage" not in r:
                    stats["errors"] += 1
                    errors.append(str(r.get("error", r))[:200])
                    continue
                u = r["usage"]
                stats["prompt_tokens"] += u.get("prompt_tokens", 0)
                stats["output_tokens"] += u.get("completion_tokens", 0)
                stats["cached_tokens"] += (u.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                ) or 0
                stats["latency_s"] += dt

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(run_session, range(len(traces))))
    wall = time.perf_counter() - t0
    out = dict(stats)
    out["wall_s"] = wall
    out["output_tok_per_s"] = stats["output_tokens"] / wall if wall else 0.0
    out["prefix_hit_rate"] = stats["cached_tokens"] / max(1, stats["prompt_tokens"])
    out["mean_s_per_output_token"] = stats["latency_s"] / max(1, stats["output_tokens"])
    out["error_samples"] = errors[:5]
    return out


# ---- positions: IntentKV on SGLang vs the embedded engine, same prompt ----------------------

POSITIONS_MODEL = "LlamaForCausalLM"


def positions_prompt(path: str | None, trace: int) -> list[dict[str, Any]]:
    """A real tau-bench prompt: trajectory ``trace``'s opening (system policy and the text
    turns) up to the last user message before its first tool call."""
    msgs = load_tau_bench(path)[trace].messages
    end = next(
        (i for i, m in enumerate(msgs) if m.get("tool_calls") or m["role"] == "tool"), len(msgs)
    )
    while end > 0 and msgs[end - 1]["role"] != "user":
        end -= 1
    return [{"role": m["role"], "content": m["content"]} for m in msgs[:end]]


def _evicted(kept) -> list[int]:
    """Positions no (layer, KV head) keeps (``kept`` bool ``[L, Hkv, T]``): the slots an
    SGLang plan frees."""
    T = kept.shape[-1]
    return [int(i) for i in (~kept.reshape(-1, T).any(dim=0)).nonzero().reshape(-1)]


def positions_embedded(prompt_file: str, spec: str, model_dir: str) -> dict[str, Any]:
    """The embedded engine (this machine's transformers) on the prompt: its tags, the
    policy's evicted positions, and an HF directory of the same weights for SGLang (the
    engine's own dequantized copy of the default GGUF, plus ``architectures``)."""
    import torch

    from agentkv.engine.engine import Engine
    from agentkv.engine.model_loader import resolve_model_dir
    from agentkv.integrations.sglang.request_plan import encode_tags

    messages = json.loads(Path(prompt_file).read_text())["messages"]
    policy = parse_policy(spec)
    eng = Engine()
    payload = build_payload(messages, policy, "pos-embedded")
    tags = eng.renderer.encode(messages, None, payload.messages)
    res = eng.compress(tags, policy)
    evicted = _evicted(res.kept)
    src, dst = resolve_model_dir(None), Path(model_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = [type(eng.model).__name__]
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return {
        "spec": spec,
        "policy": policy.describe(),
        "messages": messages,
        "token_ids": list(tags.token_ids),
        "tags": encode_tags(tags),
        "prompt_tokens": len(tags),
        "evicted": evicted,
        "forced": int(res.forced.sum()),
        "usage": res.usage.model_dump(),
        "device": str(eng.device),
        "dtype": str(eng.dtype),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def positions_cpu(embedded: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """The plugin's scheduler-side path in-process on CPU, without a server: SGLang's
    ``LlamaForCausalLM`` on the embedded engine's weights (fp32, TP = 1 on gloo, SGLang's
    ``TorchNativeAttnBackend``), the plugin's decoder-layer hooks installed, the prompt as one
    extend ``ForwardBatch`` on SGLang's pools, then the plugin's ``before_extend`` /
    ``plan_one`` (the embedded engine's ids and tags), and the evicted positions compared with
    the engine's. Methods that score from layer inputs (KVzap); the attention observers
    (IntentKV, SnapKV, H2O) are fed by the Triton backend, which is not used here."""
    import contextlib
    import socket
    from array import array
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    for op in ("nms", "qnms"):  # PyPI's torchvision on CPU torch: as tests/integrations/sglang
        with contextlib.suppress(RuntimeError):
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=model_dir, page_size=1, device="cpu"), role="test")
    import sglang.srt.layers.rotary_embedding.base as rope
    import transformers
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.sampling.sampling_params import SamplingParams

    from agentkv.integrations.sglang.hidden_states import install_hidden_state_hooks
    from agentkv.integrations.sglang.request_plan import HOLEY, request_state
    from agentkv.integrations.sglang.runtime import Planner, before_extend, plan_one
    from agentkv.integrations.sglang.slot_refcounts import RefCountedTokenAllocator
    from agentkv.methods.base import ModelShape

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1)
    cfg = transformers.LlamaConfig.from_pretrained(model_dir)
    initialize_dp_attention(
        ServerArgs(model_path=model_dir, page_size=1, device="cpu"),
        SimpleNamespace(hf_config=cfg, hidden_size=cfg.hidden_size, dtype=torch.float32),
    )
    was, rope._is_cpu = rope._is_cpu, True  # SGLang's CPU rope (else vLLM's kernel)
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        rope._is_cpu = was
    model.load_weights(list(load_file(str(Path(model_dir) / "model.safetensors")).items()))
    install_hidden_state_hooks(model)

    ids = embedded["token_ids"]
    T = len(ids)
    L, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    r2t = ReqToTokenPool(size=2, max_context_len=T + 8, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=T + 16,
        page_size=1,
        dtype=torch.float32,
        head_num=hkv,
        head_dim=d,
        layer_num=L,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = RefCountedTokenAllocator(T + 16, torch.float32, "cpu", kv, need_sort=False)
    planner = Planner(ModelShape(L, cfg.num_attention_heads, hkv, d), 2 * L * hkv * d * 4)
    import agentkv.integrations.sglang.runtime as runtime

    runtime._PLANNER = planner
    payload = encode_payload(
        build_payload(embedded["messages"], parse_policy(embedded["spec"]), "pos-cpu")
    )
    sp = SamplingParams(
        max_new_tokens=1, custom_params={"agentkv": payload, "agentkv_tags": embedded["tags"]}
    )
    req = Req("pos-cpu", "", array("q", ids), sp)
    req.prefix_indices = torch.empty(0, dtype=torch.int64)
    r2t.alloc([req])
    slots = alloc.alloc(T)
    r2t.req_to_token[req.req_pool_idx, :T] = slots.to(torch.int32)
    HOLEY.dead_slot = alloc.dead_slot
    sched = SimpleNamespace(
        token_to_kv_pool_allocator=alloc,
        model_config=SimpleNamespace(num_attention_heads=cfg.num_attention_heads),
        tp_size=1,
    )
    before_extend(sched, SimpleNamespace(reqs=[req]))
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=torch.tensor(ids),
        req_pool_indices=torch.tensor([req.req_pool_idx]),
        seq_lens=torch.tensor([T]),
        out_cache_loc=slots.to(torch.int64),
        seq_lens_sum=T,
        positions=torch.arange(T),
        extend_start_loc=torch.tensor([0]),
        extend_seq_lens=torch.tensor([T]),
        extend_prefix_lens=torch.tensor([0]),
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[T],
    )
    backend = TorchNativeAttnBackend(
        SimpleNamespace(device="cpu", req_to_token_pool=r2t, token_to_kv_pool=kv)
    )
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    t0 = time.perf_counter()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        model.model(fb.input_ids, fb.positions, fb)
    forward_s = time.perf_counter() - t0
    state = request_state(req)
    n = plan_one(planner, r2t, alloc, req, state)
    row = r2t.req_to_token[req.req_pool_idx, :T].to(torch.int64)
    evicted = torch.nonzero(row == alloc.dead_slot).reshape(-1).tolist()
    a, b = set(embedded["evicted"]), set(evicted)
    return {
        "label": "cpu-in-process",
        "evicted": len(evicted),
        "evicted_plan": n,
        "plan_note": state.usage["plan_note"],
        "jaccard_evicted": round(jaccard(a, b), 4),
        "jaccard_kept": round(jaccard(set(range(T)) - a, set(range(T)) - b), 4),
        "only_sglang": sorted(b - a),
        "only_embedded": sorted(a - b),
        "forward_s": round(forward_s, 2),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


_POSITIONS = re.compile(r"agentkv positions session=(\S+) evicted (\[[\d, ]*\])")
_PLAN = re.compile(r"agentkv plan session=(\S+) .*")


def positions_sglang(url: str, log: str, embedded: dict[str, Any], label: str) -> dict[str, Any]:
    """The same prompt on a plugin server started with ``AGENTKV_SGLANG_LOG_POSITIONS=1``:
    once through ``/generate`` with the embedded engine's token ids and tags (the plan alone
    compared), once through the chat endpoint (SGLang's template, tagged by the plugin)."""
    policy = parse_policy(embedded["spec"])
    T, ref = embedded["prompt_tokens"], set(embedded["evicted"])
    messages = embedded["messages"]
    sessions = {"generate": f"pos-gen-{label}", "chat": f"pos-chat-{label}"}
    answers: dict[str, Any] = {}
    flush(url)
    answers["generate"] = post(
        url + "/generate",
        {
            "input_ids": embedded["token_ids"],
            "sampling_params": {
                "max_new_tokens": 2,
                "temperature": 0,
                "custom_params": {
                    "agentkv": encode_payload(
                        build_payload(messages, policy, sessions["generate"])
                    ),
                    "agentkv_tags": embedded["tags"],
                },
            },
        },
    )
    flush(url)
    answers["chat"] = post(
        url + "/v1/chat/completions",
        {
            "model": "default",
            "messages": messages,
            "max_tokens": 2,
            "temperature": 0,
            "custom_params": {
                "agentkv": encode_payload(build_payload(messages, policy, sessions["chat"]))
            },
        },
    )
    time.sleep(2)  # the scheduler's log lines
    text = Path(log).read_text(errors="replace")
    found = {sid: json.loads(ev) for sid, ev in _POSITIONS.findall(text)}
    plans = {m.group(1): m.group(0) for m in _PLAN.finditer(text)}
    out: dict[str, Any] = {"label": label}
    for path, sid in sessions.items():
        r = answers[path]
        got = found.get(sid)
        row: dict[str, Any] = {"error": r.get("error"), "plan_line": plans.get(sid)}
        if path == "chat":
            row["usage_agentkv"] = (r.get("usage") or {}).get("agentkv")
            row["prompt_tokens"] = (r.get("usage") or {}).get("prompt_tokens")
        else:
            from_meta = [x for x in (r.get("meta_info") or {}).get("agentkv") or [] if x]
            row["usage_agentkv"] = from_meta[-1] if from_meta else None
            row["prompt_tokens"] = (r.get("meta_info") or {}).get("prompt_tokens")
        if got is not None:
            a = set(got)
            kept_a, kept_b = set(range(T)) - a, set(range(T)) - ref
            row.update(
                evicted=len(a),
                evicted_embedded=len(ref),
                jaccard_evicted=round(jaccard(a, ref), 4),
                jaccard_kept=round(jaccard(kept_a, kept_b), 4),
                only_sglang=sorted(a - ref)[:50],
                only_embedded=sorted(ref - a)[:50],
            )
        out[path] = row
        print(
            f"{label} {path}: {json.dumps({k: v for k, v in row.items() if k != 'usage_agentkv'})}"
        )
    return out


# ---- langgraph: a real LangGraph graph with per-node policies against the plugin server -------

#: node -> policy of the graph (methods the plugin serves). ``act`` streams its call.
LANGGRAPH_NODES = {
    "plan": "intentkv:budget=256",
    "act": "streamingllm:budget=256,sinks=4",
    "answer": "full",
}


class GraphState(TypedDict):
    """The graph's state: OpenAI-format messages, appended by each node."""

    messages: Annotated[list[dict[str, Any]], operator.add]


def langgraph_run(url: str, turns: int, trace: int, max_tokens: int) -> dict[str, Any]:
    """``plan -> act -> answer`` on LangGraph, wrapped by ``with_kv_policy`` (one policy per
    node, the thread id as session), the nodes calling the server with the OpenAI SDK. The
    conversation is a tau-bench trajectory's: its system policy, one of its user messages per
    turn. Each call's HTTP status, ``usage.agentkv`` and ``cached_tokens`` are recorded."""
    import openai
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    from agentkv import usage as kv_usage
    from agentkv.integrations.langgraph import with_kv_policy

    msgs = load_tau_bench()[trace].messages
    system = next(m["content"] for m in msgs if m["role"] == "system")
    users = [m["content"] for m in msgs if m["role"] == "user" and m.get("content")][:turns]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    calls: list[dict[str, Any]] = []

    def call(node: str, messages: list[dict[str, Any]], stream: bool) -> str:
        row: dict[str, Any] = {"node": node, "stream": stream, "prompt_messages": len(messages)}
        t = time.perf_counter()
        try:
            kwargs = {"model": "default", "messages": messages, "max_tokens": max_tokens}
            if stream:
                text, usage, ak = "", None, None
                # no stream_options: the server sends usage.agentkv in the last chunk unless
                # told not to (the embedded server's default, the plugin's for agentkv requests)
                for chunk in client.chat.completions.create(**kwargs, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                    if chunk.usage is not None:
                        usage, ak = chunk.usage, kv_usage(chunk)
            else:
                r = client.chat.completions.create(**kwargs)
                text, usage, ak = r.choices[0].message.content or "", r.usage, kv_usage(r)
            details = getattr(usage, "prompt_tokens_details", None)
            row.update(
                ok=True,
                prompt_tokens=getattr(usage, "prompt_tokens", None),
                cached_tokens=getattr(details, "cached_tokens", 0) or 0,  # SGLang's report
                prefix_hit_tokens=(ak or {}).get("prefix_hit_tokens", 0),  # agentkv's
                agentkv=ak,
            )
        except openai.APIError as e:
            text = ""
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["wall_s"] = round(time.perf_counter() - t, 3)
        calls.append(row)
        return text

    def node(name: str, instruction: str, stream: bool = False):
        def run(state: GraphState) -> dict[str, Any]:
            messages = [
                {"role": "system", "content": system},
                *state["messages"],
                {"role": "user", "content": instruction},
            ]
            return {"messages": [{"role": "assistant", "content": call(name, messages, stream)}]}

        return run

    builder = StateGraph(GraphState)
    builder.add_node("plan", node("plan", "Plan the next steps for this customer in one line."))
    builder.add_node("act", node("act", "Say which tool you would call next.", stream=True))
    builder.add_node("answer", node("answer", "Reply to the customer in two sentences."))
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "act")
    builder.add_edge("act", "answer")
    builder.add_edge("answer", END)
    graph = with_kv_policy(builder, "full", LANGGRAPH_NODES, checkpointer=InMemorySaver())
    thread = {"configurable": {"thread_id": f"langgraph-{trace}"}}
    for i, text in enumerate(users):
        graph.invoke({"messages": [{"role": "user", "content": text}]}, thread)
        for row in calls:
            row.setdefault("turn", i)
    ok = [c for c in calls if c.get("ok")]
    with_usage = [c for c in ok if c.get("agentkv")]
    later = [c for c in ok if c["turn"] > 0]
    checks = {
        "all_answered": len(ok) == len(calls) == 3 * len(users),
        "usage_agentkv_on_every_call": len(with_usage) == len(ok),
        "streamed_usage_agentkv": any(c["stream"] and c.get("agentkv") for c in ok),
        "methods_per_node": all(
            c["agentkv"]["method"] == parse_policy(LANGGRAPH_NODES[c["node"]]).method
            and c["agentkv"]["node"] == c["node"]
            for c in with_usage
        ),
        "one_session": len({c["agentkv"]["session_id"] for c in with_usage}) == 1,
        "evicted_tokens": sum(c["agentkv"]["evicted_tokens"] for c in with_usage),
        "cached_tokens_after_turn_0": sum(c["cached_tokens"] for c in later),
        "prefix_hit_tokens_after_turn_0": sum(c["prefix_hit_tokens"] for c in later),
    }
    checks["ok"] = bool(
        checks["all_answered"]
        and checks["usage_agentkv_on_every_call"]
        and checks["streamed_usage_agentkv"]
        and checks["methods_per_node"]
        and checks["one_session"]
        and checks["evicted_tokens"] > 0
        and (turns < 2 or checks["prefix_hit_tokens_after_turn_0"] > 0)
    )
    for c in calls:
        ak = c.get("agentkv") or {}
        print(
            f"turn {c['turn']} {c['node']:6s} ok={c.get('ok')} prompt={c.get('prompt_tokens')} "
            f"cached={c.get('cached_tokens')} hit={c.get('prefix_hit_tokens')} "
            f"evicted={ak.get('evicted_tokens')} "
            f"live={ak.get('live_kv_tokens')} {c.get('error', '')}"
        )
    return {"nodes": LANGGRAPH_NODES, "turns": len(users), "checks": checks, "calls": calls}


_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?#token: (\d+).*?token usage: ([\d.]+)")
_QUEUE = re.compile(r"(?:Decode|Prefill) batch.*?#queue-req: (\d+)")


def log_stats(path: str | None, since: int = 0) -> dict[str, Any]:
    """Peak running requests, peak KV tokens and usage, retractions, agentkv plans: from an
    SGLang server log, reading from byte ``since``."""
    if not path or not Path(path).is_file():
        return {}
    text = Path(path).read_text(errors="replace")[since:]
    dec = [(int(a), int(b), float(c)) for a, b, c in _DECODE.findall(text)]
    return {
        "peak_running_req": max((d[0] for d in dec), default=0),
        "peak_kv_tokens": max((d[1] for d in dec), default=0),
        "peak_token_usage": max((d[2] for d in dec), default=0.0),
        "peak_queue_req": max((int(q) for q in _QUEUE.findall(text)), default=0),
        "retractions": sum(int(x) for x in re.findall(r"#retracted_reqs: (\d+)", text)),
        "agentkv_plans": text.count("agentkv plan"),
        "agentkv_evicted": sum(int(x) for x in re.findall(r"agentkv plan .*?evicted (\d+)", text)),
        # the plugin's host time per stage (AGENTKV_SGLANG_HOST_TIME_S lines; both processes)
        "agentkv_host_ms": parse_host_time(text),
        "log_bytes": len(text),
    }


def top_host_stages(host_ms: dict[str, dict[str, float]] | None, n: int = 3) -> str:
    """``host: plan 412 ms, sync 95 ms, tag 80 ms``: the costliest stages of a run's
    ``agentkv_host_ms`` (empty without any)."""
    if not host_ms:
        return ""
    top = sorted(host_ms.items(), key=lambda kv: -kv[1]["ms"])[:n]
    return "host: " + ", ".join(f"{k} {v['ms']:.0f} ms" for k, v in top)


#: what "a level holds" means (``capacity --criterion``, ``sglang_capacity_predict.py``)
CRITERIA = ("no-queue", "no-retraction")


def level_holds(
    criterion: str,
    level: int,
    *,
    retractions: int,
    peak_running: int,
    peak_queue: int,
    errors: int = 0,
) -> bool:
    """Whether ``level`` concurrent sessions held. ``no-retraction``: no request failed or was
    retracted and all ``level`` sessions ran at once (peak running requests ``>= level``).
    ``no-queue``: that, and no request ever waited in the scheduler's queue (``peak_queue``
    0): SGLang holds back a request whose prompt and ``max_new_tokens`` do not fit what the
    running requests may still take, and admits nothing more until one of them leaves, so
    past its room the sessions take turns instead of running at once."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion {criterion!r}: one of {', '.join(CRITERIA)}")
    ok = errors == 0 and retractions == 0 and peak_running >= level
    return ok and (criterion == "no-retraction" or peak_queue == 0)


def bisect_capacity(held: int, failed: int, holds: Callable[[int], bool]) -> tuple[int, int]:
    """Narrow ``held < failed`` (a level that held, one that failed) to adjacent integers,
    running ``holds(level)`` on midpoints; returns the last holding and first failing level."""
    while failed - held > 1:
        mid = (held + failed) // 2
        if holds(mid):
            held = mid
        else:
            failed = mid
    return held, failed


def capacity(
    a: argparse.Namespace, levels: list[int], specs: list[str], out: Path
) -> dict[str, Any]:
    """Max concurrent sessions, per policy: at each level L (ascending), L sessions replay
    their first ``--max-turns`` turns at once (concurrency L); a level holds under
    ``--criterion`` (:func:`level_holds` on the server log's retractions, peak running
    requests and peak ``#queue-req``; each row also says whether it held under either
    criterion). Stops at a policy's first failing level; with ``--bisect``, then bisects
    between the last holding level (``--bisect-from`` when none of ``--levels`` held) and
    the first failing one, to one session."""
    pool = load_tau_bench(seed=a.seed)
    # more sessions than trajectories: trajectories repeat (as distinct sessions)
    traces = [pool[i % len(pool)] for i in range(max(levels))]
    rows = []
    summary = {}
    for spec in specs:
        name, url, log, policy = _target(a, spec)
        if a.warmup:
            # one session's first turn, not counted: a policy's first request on a server pays
            # one-off costs (kernel compilation, first plan; SnapKV's took ~2 s), during which
            # every session of the level arrives and queues for the prefill chunks: a queue
            # that says nothing about memory
            warm = f"warm-{name}".replace(" ", "_")
            replay(url, traces[:1], policy, 1, a.max_tokens, a.tools, warm, 1)

        def run_level(level: int, name=name, url=url, log=log, policy=policy) -> bool:
            flush(url)
            since = Path(log).stat().st_size if log and Path(log).is_file() else 0
            r = replay(
                url,
                traces[:level],
                policy,
                level,
                a.max_tokens,
                a.tools,
                tag=f"cap{level}-{name}".replace(" ", "_"),
                max_turns=a.max_turns,
            )
            r.update(log_stats(log, since))
            if "retractions" not in r:
                raise SystemExit(f"capacity needs the server's log ({name}: --*-log)")
            verdict = {
                c: level_holds(
                    c,
                    level,
                    retractions=r["retractions"],
                    peak_running=r["peak_running_req"],
                    peak_queue=r["peak_queue_req"],
                    errors=r["errors"],
                )
                for c in CRITERIA
            }
            ok = verdict[a.criterion]
            r.update(run=name, level=level, holds=ok, criterion=a.criterion)
            r.update({f"holds_{c.replace('-', '_')}": v for c, v in verdict.items()})
            rows.append(r)
            print(
                f"{name} L={level}: holds={ok} ({a.criterion}) retracted={r['retractions']} "
                f"peak running={r['peak_running_req']} queue={r['peak_queue_req']} "
                f"kv={r['peak_kv_tokens']} hit={r['prefix_hit_rate']:.3f} "
                f"tok/s={r['output_tok_per_s']:.0f} {top_host_stages(r.get('agentkv_host_ms'))}"
            )
            (out / "capacity.json").write_text(
                json.dumps({"levels": levels, "rows": rows}, indent=1)
            )
            return ok

        held, failed = a.bisect_from, None
        for level in levels:
            if not run_level(level):
                failed = level
                break
            held = level
        if a.bisect and failed is not None:
            held, failed = bisect_capacity(held, failed, run_level)
        summary[name] = {"max_level_held": held, "first_failing": failed}
        print(f"{name}: max concurrent sessions ({a.criterion}) {held} (fails at {failed})")
    return {
        "levels": levels,
        "max_turns": a.max_turns,
        "criterion": a.criterion,
        "summary": summary,
        "rows": rows,
    }


def _target(a: argparse.Namespace, spec: str):
    """(run name, server URL, server log, policy or None) of one ``--policies`` entry."""
    if spec == "stock":
        return "stock", a.stock, a.stock_log, None
    if spec == "nopayload":  # the plugin server, requests without an agentkv payload
        return "plugin nopayload", a.plugin, a.plugin_log, None
    return f"plugin {spec}", a.plugin, a.plugin_log, parse_policy(spec)


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    """``rows`` as a markdown table of ``cols`` on stdout (floats to 4 significant digits)."""
    print("| " + " | ".join(cols) + " |")
    for r in rows:
        cells = (f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols)
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "phase",
        choices=[
            "check",
            "replay",
            "capacity",
            "langgraph",
            "positions-prompt",
            "positions-embedded",
            "positions-sglang",
            "positions-cpu",
        ],
    )
    ap.add_argument("--stock", help="stock SGLang server URL (check, replay)")
    ap.add_argument("--plugin", help="plugin server URL (check, replay, langgraph, positions)")
    ap.add_argument("--stock-log")
    ap.add_argument("--plugin-log")
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-turns", type=int, help="replay / capacity: first N turns per session")
    ap.add_argument(
        "--levels",
        default="32,64,96,128,192,256",
        help="capacity: concurrent-session levels, ascending",
    )
    ap.add_argument(
        "--bisect",
        action="store_true",
        help="capacity: after the first failing level, bisect down to one session",
    )
    ap.add_argument(
        "--criterion",
        choices=CRITERIA,
        default="no-queue",
        help="capacity: a level holds with no retraction, every session running at once and "
        "(no-queue) no request ever waiting in the server's queue",
    )
    ap.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capacity: one uncounted request per policy before its first level",
    )
    ap.add_argument(
        "--bisect-from",
        type=int,
        default=0,
        help="capacity --bisect: a level known to hold, when none of --levels holds",
    )
    ap.add_argument("--tools", action="store_true", help="send the trajectories' tool schemas")
    ap.add_argument(
        "--policies",
        default="stock,full,streamingllm:budget=512,intentkv:budget=512",
        help="runs in order: 'stock' = the stock server without payload, 'nopayload' = the "
        "plugin server without payload, else a policy spec "
        "sent to the plugin server",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--trace", type=int, default=0, help="tau-bench trajectory (langgraph, positions)"
    )
    ap.add_argument("--turns", type=int, default=3, help="langgraph: user turns")
    ap.add_argument(
        "--policy", default="intentkv:budget=512,protect_system=false", help="positions: the policy"
    )
    ap.add_argument("--prompt-file", help="positions: the prompt JSON (positions-prompt)")
    ap.add_argument(
        "--model-dir",
        help="positions-embedded: where to write SGLang's model dir; positions-cpu: read it",
    )
    ap.add_argument("--embedded", help="positions-sglang: positions_embedded.json")
    ap.add_argument("--label", default="hf", help="positions-sglang: the server's label")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase == "positions-prompt":
        (out / "positions_prompt.json").write_text(
            json.dumps({"trace": a.trace, "messages": positions_prompt(None, a.trace)}, indent=1)
        )
        return
    if a.phase == "positions-embedded":
        res = positions_embedded(a.prompt_file, a.policy, a.model_dir)
        print(
            f"embedded: {res['prompt_tokens']} tokens, {len(res['evicted'])} evicted "
            f"({res['policy']}, {res['device']}, transformers {res['transformers']})"
        )
        (out / "positions_embedded.json").write_text(json.dumps(res, indent=1))
        return
    if a.phase in ("positions-sglang", "positions-cpu"):
        embedded = json.loads(Path(a.embedded).read_text())
        if a.phase == "positions-cpu":
            res = positions_cpu(embedded, a.model_dir)
            print(json.dumps({k: v for k, v in res.items() if not k.startswith("only")}))
        else:
            res = positions_sglang(a.plugin, a.plugin_log, embedded, a.label)
        path = out / "positions.json"
        runs = json.loads(path.read_text())["runs"] if path.is_file() else []
        runs = [r for r in runs if r["label"] != a.label] + [res]
        summary = {
            "policy": embedded["policy"],
            "prompt_tokens": embedded["prompt_tokens"],
            "evicted_embedded": len(embedded["evicted"]),
            "embedded": {k: embedded[k] for k in ("device", "dtype", "torch", "transformers")},
            "runs": runs,
        }
        path.write_text(json.dumps(summary, indent=1))
        return
    if a.phase == "langgraph":
        # LangGraph / LangChain wheels the GPU image lacks (sglang_plugin.sh prepare): after
        # everything else on the path, so the image's and the bundle's packages win
        if os.environ.get("AGENTKV_LANGGRAPH_SITE"):
            sys.path.append(os.environ["AGENTKV_LANGGRAPH_SITE"])
        res = langgraph_run(a.plugin, a.turns, a.trace, a.max_tokens)
        res["plugin_log"] = log_stats(a.plugin_log)
        print(json.dumps(res["checks"], indent=1))
        (out / "langgraph.json").write_text(json.dumps(res, indent=1))
        return
    if a.phase == "capacity":
        res = capacity(a, [int(x) for x in a.levels.split(",")], a.policies.split(","), out)
        (out / "capacity.json").write_text(json.dumps(res, indent=1))
        return
    if a.phase == "check":
        res = check(a.stock, a.plugin, a.prompts, a.seed)
        res["plugin_log"] = log_stats(a.plugin_log)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}, indent=1))
    else:
        traces = load_tau_bench(limit=a.sessions, seed=a.seed)
        runs = []
        for spec in a.policies.split(","):
            name, url, log, policy = _target(a, spec)
            flush(url)
            since = Path(log).stat().st_size if log and Path(log).is_file() else 0
            r = replay(
                url,
                traces,
                policy,
                a.concurrency,
                a.max_tokens,
                a.tools,
                tag=name.replace(" ", "_"),
                max_turns=a.max_turns,
            )
            r.update(log_stats(log, since))
            r["run"] = name
            runs.append(r)
            print(json.dumps(r))
        res = {
            "sessions": len(traces),
            "concurrency": a.concurrency,
            "max_tokens": a.max_tokens,
            "runs": runs,
        }
        cols = [
            "run",
            "requests",
            "errors",
            "output_tok_per_s",
            "mean_s_per_output_token",
            "prefix_hit_rate",
            "peak_running_req",
            "peak_kv_tokens",
            "retractions",
            "agentkv_evicted",
        ]
        print_table(runs, cols)
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
