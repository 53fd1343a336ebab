"""Multi-turn tool-use traces for benchmarks and tests: OpenAI-format conversations.

Sources (all offline, no torch import):

- ``tau-bench``: 200 real GPT-4o airline trajectories (``../shared/data/tau-bench/``, or the
  file named by ``$AGENTKV_TAU_BENCH``). The file has no tool schemas; minimal OpenAI tool
  schemas are inferred from the tool calls recorded in it.
- ``bfcl``: BFCL v4 multi-turn examples from the ``bfcl-eval`` package, with tool results
  produced by executing the ground-truth calls on BFCL's bundled simulators
  (:mod:`agentkv.bench.bfcl_traces`).
- JSONL files of user traces: one ``{"messages": [...], "tools": [...]}`` object per line.

``limit`` takes a deterministic sample: ids sorted (naturally: ``..._2`` before ``..._10``),
``limit`` of them drawn with ``random.Random(seed)``, returned in id order.
"""

from __future__ import annotations

import copy
import json
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentkv.annotation import annotate_messages

#: Repository root (``agentkv/bench/traces.py`` -> ``.``); shared data sits next to it.
REPO_ROOT = Path(__file__).resolve().parents[2]
TAU_BENCH_ENV = "AGENTKV_TAU_BENCH"
DEFAULT_TAU_BENCH = REPO_ROOT.parent / "shared" / "data" / "tau-bench" / "gpt-4o-airline.json"

SOURCES = ("tau-bench", "bfcl")


@dataclass
class Trace:
    """One conversation: OpenAI-format ``messages`` plus the OpenAI tool schemas it may call."""

    id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    #: source-specific extras (task id, trial, reward, BFCL category, ...).
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One JSONL line that :func:`load_jsonl` reads back into an equal trace."""
        return json.dumps(
            {
                "id": self.id,
                "source": self.source,
                "messages": self.messages,
                "tools": self.tools,
                "meta": self.meta,
            },
            ensure_ascii=False,
        )

    @property
    def num_tool_calls(self) -> int:
        return sum(len(m.get("tool_calls") or ()) for m in self.messages)


class TraceFormatError(ValueError):
    """Malformed trace input; ``line`` is the 1-based JSONL line when known."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.line = line


# --------------------------------------------------------------------------- sampling


def _natural_key(text: str) -> list[Any]:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t]


def sample(traces: Sequence[Trace], limit: int | None = None, seed: int = 0) -> list[Trace]:
    """Deterministic sample: ``limit`` traces drawn with ``seed`` from the id-sorted list,
    returned in id order. Samples are nested: a smaller ``limit`` picks a subset of a larger
    one (the first ``limit`` of one seeded permutation)."""
    ordered = sorted(traces, key=lambda t: _natural_key(t.id))
    if limit is None or limit >= len(ordered):
        return ordered
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    permutation = random.Random(seed).sample(range(len(ordered)), len(ordered))
    return [ordered[i] for i in sorted(permutation[:limit])]


def sample_ids(ids: Iterable[str], limit: int | None = None, seed: int = 0) -> list[str]:
    """:func:`sample` for bare ids (to pick before doing expensive work per trace)."""
    return [t.id for t in sample([Trace(i, "", []) for i in ids], limit, seed)]


# --------------------------------------------------------------------------- checks


def check_tool_calls(messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` unless every tool result answers a call of the assistant message
    right before its run of tool messages, and every such call is answered.

    Positional on purpose: real trajectories reuse call ids across steps (tau-bench does).
    """
    pending: list[str] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in pending:
                raise ValueError(f"message {i}: tool_call_id {call_id!r} answers no open call")
            pending.remove(call_id)
            continue
        if pending:
            raise ValueError(f"message {i}: tool calls {pending} were never answered")
        if role == "assistant":
            pending = [c["id"] for c in m.get("tool_calls") or ()]
    if pending:
        raise ValueError(f"tool calls {pending} at the end were never answered")


# --------------------------------------------------------------------------- tool schemas


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return "string"


def infer_schema(value: Any) -> dict[str, Any]:
    """Minimal JSON Schema of one JSON value."""
    kind = _json_type(value)
    if kind == "array":
        items: dict[str, Any] | None = None
        for v in value:
            items = infer_schema(v) if items is None else merge_schemas(items, infer_schema(v))
        return {"type": "array", "items": items} if items else {"type": "array"}
    if kind == "object":
        return {
            "type": "object",
            "properties": {k: infer_schema(v) for k, v in value.items()},
            "required": sorted(value),
        }
    return {"type": kind}


def merge_schemas(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A schema that accepts what ``a`` or ``b`` accepts (as far as inference needs)."""
    ta, tb = a.get("type"), b.get("type")
    if ta == tb == "object":
        props = dict(a.get("properties", {}))
        for k, v in b.get("properties", {}).items():
            props[k] = merge_schemas(props[k], v) if k in props else v
        required = sorted(set(a.get("required", ())) & set(b.get("required", ())))
        return {"type": "object", "properties": props, "required": required}
    if ta == tb == "array":
        if "items" in a and "items" in b:
            return {"type": "array", "items": merge_schemas(a["items"], b["items"])}
        return a if "items" in a else b
    if ta == tb:
        return a
    if {ta, tb} == {"integer", "number"}:
        return {"type": "number"}
    types = sorted({*_as_list(ta), *_as_list(tb)})
    return {"type": types}


def _as_list(t: Any) -> list[str]:
    return list(t) if isinstance(t, list) else [t]


def tools_from_calls(messages_lists: Iterable[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """OpenAI tool schemas inferred from the tool calls in some conversations, sorted by name.

    A parameter is required when every recorded call passed it.
    """
    params: dict[str, dict[str, Any]] = {}
    for messages in messages_lists:
        for m in messages:
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                args = json.loads(fn["arguments"] or "{}")
                if not isinstance(args, Mapping):
                    raise ValueError(f"tool call {fn['name']!r}: arguments are not a JSON object")
                schema = infer_schema(args)
                name = fn["name"]
                params[name] = merge_schemas(params[name], schema) if name in params else schema
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"The {name} tool (parameters inferred from recorded calls).",
                "parameters": params[name],
            },
        }
        for name in sorted(params)
    ]


# --------------------------------------------------------------------------- tau-bench

_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def tau_bench_path(path: str | os.PathLike[str] | None = None) -> Path:
    """``path``, else ``$AGENTKV_TAU_BENCH``, else the shared copy next to the repository."""
    chosen = Path(path or os.environ.get(TAU_BENCH_ENV) or DEFAULT_TAU_BENCH)
    if not chosen.is_file():
        raise FileNotFoundError(
            f"tau-bench trajectories not found at {chosen}; pass path=... or set "
            f"${TAU_BENCH_ENV} to a tau-bench results JSON (a list of {{task_id, trial, traj}})"
        )
    return chosen


def load_tau_bench(
    path: str | os.PathLike[str] | None = None, limit: int | None = None, seed: int = 0
) -> list[Trace]:
    """tau-bench trajectories as traces (ids ``tau-bench/<domain>/<task_id>/<trial>``).

    Tool schemas are inferred from all calls in the file, so every trace of one file carries
    the same tool list.
    """
    file = tau_bench_path(path)
    with open(file) as f:
        items = json.load(f)
    if not isinstance(items, list):
        raise TraceFormatError(f"{file}: expected a JSON list of trajectories")
    domain = file.stem.rsplit("-", 1)[-1]
    conversations: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = []
    for n, item in enumerate(items):
        if not isinstance(item, Mapping) or not isinstance(item.get("traj"), list):
            raise TraceFormatError(f"{file}: item {n} has no 'traj' list of messages")
        messages = [{k: copy.deepcopy(m[k]) for k in _MESSAGE_KEYS if k in m} for m in item["traj"]]
        task, trial = item.get("task_id", n), item.get("trial", 0)
        meta = {"task_id": task, "trial": trial, "reward": item.get("reward")}
        conversations.append((f"tau-bench/{domain}/{task}/{trial}", messages, meta))
    tools = tools_from_calls(msgs for _, msgs, _ in conversations)
    traces = [
        Trace(id=i, source="tau-bench", messages=msgs, tools=copy.deepcopy(tools), meta=meta)
        for i, msgs, meta in conversations
    ]
    if len({t.id for t in traces}) != len(traces):
        raise TraceFormatError(f"{file}: duplicate (task_id, trial) pairs")
    return sample(traces, limit, seed)


# --------------------------------------------------------------------------- JSONL


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(
            f"'tools' must be a list of OpenAI tool schemas, got {type(tools).__name__}"
        )
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(
                f"tools[{k}]: expected {{'type': 'function', 'function': {{'name': ...}}}}"
            )
    return tools


def load_jsonl(path: str | os.PathLike[str]) -> list[Trace]:
    """User traces, one ``{"messages": [...], "tools": [...]}`` object per line.

    Optional keys: ``id`` (default ``<file stem>:<line>``), ``source`` (default ``jsonl``),
    ``meta``. Blank lines are skipped. Raises :class:`TraceFormatError` naming the line.
    """
    file = Path(path)
    traces: list[Trace] = []
    seen: dict[str, int] = {}
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{file}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceFormatError(
                    f"{where}: invalid JSON: {e.msg} (col {e.colno})", lineno
                ) from None
            try:
                trace = _trace_from_obj(obj, default_id=f"{file.stem}:{lineno}")
            except (TypeError, ValueError) as e:
                raise TraceFormatError(f"{where}: {e}", lineno) from None
            if trace.id in seen:
                raise TraceFormatError(
                    f"{where}: duplicate id {trace.id!r} (first on line {seen[trace.id]})", lineno
                )
            seen[trace.id] = lineno
            traces.append(trace)
    return traces


_JSONL_KEYS = {"id", "source", "messages", "tools", "meta"}


def _trace_from_obj(obj: Any, default_id: str) -> Trace:
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _JSONL_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; expected some of {sorted(_JSONL_KEYS)}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of OpenAI messages")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{k}] must be an object, got {type(m).__name__}")
    annotate_messages(messages)  # roles, content blocks, tool calls: errors name the message
    trace_id = obj.get("id", default_id)
    if not isinstance(trace_id, str) or not trace_id:
        raise ValueError(f"'id' must be a non-empty string, got {trace_id!r}")
    meta = obj.get("meta") or {}
    if not isinstance(meta, Mapping):
        raise ValueError("'meta' must be an object")
    return Trace(
        id=trace_id,
        source=str(obj.get("source") or "jsonl"),
        messages=list(messages),
        tools=_check_tools(obj.get("tools")),
        meta=dict(meta),
    )


# --------------------------------------------------------------------------- dispatch


def load_bfcl(
    category: str = "multi_turn_base", limit: int | None = None, seed: int = 0
) -> list[Trace]:
    """BFCL multi-turn traces; see :func:`agentkv.bench.bfcl_traces.load_bfcl`."""
    from agentkv.bench.bfcl_traces import load_bfcl as _load

    return _load(category, limit=limit, seed=seed)


def load_source(name: str, limit: int | None = None, seed: int = 0) -> list[Trace]:
    """Traces by source name: ``tau-bench`` (or ``tau-bench:<path>``), ``bfcl`` (or
    ``bfcl:<category>``, e.g. ``bfcl:multi_turn_miss_func``), or a ``.jsonl`` path."""
    kind, _, arg = name.partition(":")
    if kind == "tau-bench":
        return load_tau_bench(arg or None, limit=limit, seed=seed)
    if kind == "bfcl":
        return load_bfcl(arg or "multi_turn_base", limit=limit, seed=seed)
    if name.endswith(".jsonl"):
        return sample(load_jsonl(name), limit, seed)
    raise ValueError(
        f"unknown trace source {name!r}; expected one of {list(SOURCES)} "
        "(optionally 'bfcl:<category>' / 'tau-bench:<path>') or a .jsonl path"
    )
