"""Reading the KV telemetry the engine returns (``usage.agentkv``), whatever carried it.

The engine adds ``usage.agentkv`` (per-request KV telemetry: policy, live / resident /
evicted KV, prefix hits, KV reads, wall time) to every chat completion, and to the last
chunk of a stream. :func:`usage` finds it in what users hold:

- a LangChain ``AIMessage`` / ``AIMessageChunk``: ``response_metadata["agentkv"]`` (where
  agentkv's callbacks put it, streamed or not) or ``response_metadata["token_usage"]
  ["agentkv"]`` (where ``ChatOpenAI`` leaves it for a non-streamed call);
- an OpenAI SDK ``ChatCompletion`` / ``ChatCompletionChunk`` or its ``usage``;
- the same as plain JSON dicts.

:func:`aggregate_by_node` folds many requests' telemetry into one row per graph node.
Duck-typed: no LangChain or OpenAI import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

WIRE_KEY = "agentkv"

__all__ = ["aggregate_by_node", "usage"]


def _from_usage(u: Any) -> dict[str, Any] | None:
    """``usage.agentkv`` of an OpenAI ``CompletionUsage`` (an extra field) or a dict."""
    if u is None:
        return None
    if isinstance(u, Mapping):
        found = u.get(WIRE_KEY)
    else:
        found = (getattr(u, "model_extra", None) or {}).get(WIRE_KEY)
        if found is None:
            found = getattr(u, WIRE_KEY, None)
    return dict(found) if isinstance(found, Mapping) else None


def usage(obj: Any) -> dict[str, Any] | None:
    """The KV telemetry dict of one response, or None when it carries none.

    ``obj``: a LangChain ``AIMessage`` / ``AIMessageChunk`` (streamed or not), an OpenAI SDK
    ``ChatCompletion`` / ``ChatCompletionChunk`` / ``CompletionUsage``, or their JSON dicts.
    Keys: ``method``, ``policy``, ``session_id``, ``node``, ``prompt_tokens``,
    ``prefix_hit_tokens``, ``live_kv_tokens``, ``live_kv_bytes``, ``evicted_tokens``,
    ``wall_time_s`` and the rest of the engine's ``KVUsage`` (token counts in tokens, bytes
    in bytes, times in seconds). Raises ``TypeError`` for other objects.
    """
    meta = getattr(obj, "response_metadata", None)
    if isinstance(meta, Mapping):  # LangChain message
        found = meta.get(WIRE_KEY)
        if isinstance(found, Mapping):
            return dict(found)
        return _from_usage(meta.get("token_usage"))
    if isinstance(obj, Mapping):
        if "usage" in obj or "choices" in obj or "object" in obj:
            return _from_usage(obj.get("usage"))
        return _from_usage(obj)  # a usage dict
    if hasattr(obj, "usage") and hasattr(obj, "choices"):  # ChatCompletion(Chunk)
        return _from_usage(obj.usage)
    if hasattr(obj, "prompt_tokens") and hasattr(obj, "completion_tokens"):  # CompletionUsage
        return _from_usage(obj)
    raise TypeError(
        "agentkv.usage() expects a LangChain AIMessage, an OpenAI ChatCompletion / "
        f"ChatCompletionChunk / CompletionUsage or their dicts; got {type(obj).__name__}"
    )


#: Summed per node by :func:`aggregate_by_node`; peaks are maxima.
SUMMED = (
    "prompt_tokens",
    "completion_tokens",
    "prefix_hit_tokens",
    "evicted_tokens",
    "raw_kv_reads",
    "effective_kv_reads",
    "wall_time_s",
)
PEAKS = ("peak_request_tokens", "live_kv_tokens", "live_kv_bytes", "resident_kv_bytes")


def aggregate_by_node(usages: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """One row per node (``"-"`` for requests without one) over requests' telemetry dicts.

    Row keys: ``requests``, ``policies`` (labels seen, in order), the sums of
    :data:`SUMMED`, ``peak_<key>`` for :data:`PEAKS`, and ``prefix_hit_rate`` (prefix-hit
    tokens / prompt tokens).
    """
    rows: dict[str, dict[str, Any]] = {}
    for u in usages:
        node = u.get("node") or "-"
        row = rows.setdefault(
            node,
            {"requests": 0, "policies": [], **dict.fromkeys(SUMMED, 0)}
            | {f"peak_{k}": 0 for k in PEAKS},
        )
        row["requests"] += 1
        label = u.get("policy")
        if label and label not in row["policies"]:
            row["policies"].append(label)
        for k in SUMMED:
            row[k] += u.get(k) or 0
        for k in PEAKS:
            row[f"peak_{k}"] = max(row[f"peak_{k}"], u.get(k) or 0)
    for row in rows.values():
        row["wall_time_s"] = round(row["wall_time_s"], 4)
        row["prefix_hit_rate"] = (
            row["prefix_hit_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        )
    return rows
