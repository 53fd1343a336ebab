"""Per-request and per-session KV telemetry (IntentKV §4.1 metrics).

``KVUsage`` travels back to clients as ``usage.agentkv``. Token counts are tokens; bytes are
K+V bytes over all layers at the engine's KV dtype.

- peak request tokens: prompt + generated tokens of the request;
- live KV tokens: effective live KV after pruning (mask-weighted: live (layer, KV head,
  position) entries / (L * Hkv)), at the end of the request;
- resident KV tokens: positions with at least one live cell;
- resident KV bytes: bytes of every cell the request holds, at its precision (full / INT4 /
  INT2, scales included): what the pools really hold for it, split by precision in
  ``resident_kv_bytes_by_precision``; ``live_kv_bytes`` is the same live KV counted at full
  precision (the effective bytes), so ``resident / live`` is the memory saved by quantization
  and per-head freeing;
- raw KV reads: sum over the forward passes of the request of the keys a full cache would
  attend (per query position, summed over decode steps; prefill counts once per chunk);
- effective KV reads: the same sum over keys actually attended;
- prefix-hit rate: prompt tokens reused from the prefix cache / prompt tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, Field


class KVUsage(BaseModel):
    """KV telemetry of one request (``usage.agentkv``)."""

    model_config = ConfigDict(extra="forbid")

    method: str
    policy: str = Field(description="policy label, e.g. intentkv(budget=512)")
    session_id: str
    node: str | None = None
    prompt_tokens: int
    completion_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    peak_request_tokens: int
    live_kv_tokens: float
    live_kv_bytes: int
    resident_kv_tokens: int
    resident_kv_bytes: int
    resident_kv_bytes_by_precision: dict[str, int] = Field(
        default_factory=dict, description="resident bytes split by full / int4 / int2"
    )
    quantized_entries: int = Field(0, description="(layer, KV head, position) cells quantized")
    compacted_entries: int = Field(
        0,
        description="INT4 cells moved into fuller runs after eviction had thinned them (same "
        "bytes; the decode kernel reads consecutive rows faster): kernel decode path",
    )
    slot_map_bytes: int = Field(0, description="host bytes of the request's slot map")
    planned_live_kv_tokens: float = Field(
        0.0, description="effective live KV right after the plan, before decode / target tokens"
    )
    compression_ratio: float = Field(
        0.0,
        description="fraction of the request's (layer, KV head, position) KV entries removed "
        "at its end: 1 - live_kv_tokens / positions with KV (KVzap's compression ratio)",
    )
    forced_tokens: int = Field(0, description="positions the policy had to keep (forced set)")
    evicted_tokens: int = Field(description="positions evicted by this request's plan")
    evicted_entries: int = Field(description="(layer, KV head, position) entries evicted")
    raw_kv_reads: int
    effective_kv_reads: int
    wall_time_s: float
    prefill_time_s: float = Field(0.0, description="prefill + plan (s), chat requests")
    decode_time_s: float = Field(0.0, description="decode steps (s), chat requests")
    plan_time_s: float = Field(
        0.0,
        description="planning (s): the observer's result, the method's scoring and applying "
        "the plan (evict / quantize), after the prefill; embedded engine",
    )
    plan_note: str = ""


class NodeSummary(BaseModel):
    """Aggregate over the requests of one session made by one graph node."""

    requests: int = 0
    policies: list[str] = Field(default_factory=list, description="policy labels seen")
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    completion_tokens: int = 0
    peak_live_kv_tokens: float = 0.0
    evicted_tokens: int = 0
    wall_time_s: float = 0.0

    def add(self, usage: KVUsage) -> None:
        self.requests += 1
        if usage.policy not in self.policies:
            self.policies.append(usage.policy)
        self.prompt_tokens += usage.prompt_tokens
        self.prefix_hit_tokens += usage.prefix_hit_tokens
        self.completion_tokens += usage.completion_tokens
        self.peak_live_kv_tokens = max(self.peak_live_kv_tokens, usage.live_kv_tokens)
        self.evicted_tokens += usage.evicted_tokens
        self.wall_time_s = round(self.wall_time_s + usage.wall_time_s, 4)


class SessionSummary(BaseModel):
    """Aggregate over the requests of one session."""

    session_id: str
    requests: int = 0
    nodes: list[str] = Field(default_factory=list)
    peak_request_tokens: int = 0
    peak_live_kv_tokens: float = 0.0
    peak_live_kv_bytes: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    raw_kv_reads: int = 0
    effective_kv_reads: int = 0
    evicted_tokens: int = 0
    wall_time_s: float = 0.0
    by_node: dict[str, NodeSummary] = Field(
        default_factory=dict, description='per-node aggregates ("-": requests without a node)'
    )

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, usage: KVUsage) -> None:
        self.requests += 1
        if usage.node and usage.node not in self.nodes:
            self.nodes.append(usage.node)
        self.peak_request_tokens = max(self.peak_request_tokens, usage.peak_request_tokens)
        self.peak_live_kv_tokens = max(self.peak_live_kv_tokens, usage.live_kv_tokens)
        self.peak_live_kv_bytes = max(self.peak_live_kv_bytes, usage.live_kv_bytes)
        self.prompt_tokens += usage.prompt_tokens
        self.prefix_hit_tokens += usage.prefix_hit_tokens
        self.raw_kv_reads += usage.raw_kv_reads
        self.effective_kv_reads += usage.effective_kv_reads
        self.evicted_tokens += usage.evicted_tokens
        self.wall_time_s += usage.wall_time_s
        self.by_node.setdefault(usage.node or "-", NodeSummary()).add(usage)


class SessionMetrics:
    """Thread-safe LRU of :class:`SessionSummary` by session id."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, SessionSummary] = OrderedDict()

    def record(self, usage: KVUsage) -> SessionSummary:
        with self._lock:
            summary = self._sessions.get(usage.session_id)
            if summary is None:
                summary = self._sessions[usage.session_id] = SessionSummary(
                    session_id=usage.session_id
                )
            self._sessions.move_to_end(usage.session_id)
            summary.add(usage)
            while len(self._sessions) > self.capacity:
                self._sessions.popitem(last=False)
            return summary.model_copy(deep=True)

    def get(self, session_id: str) -> SessionSummary | None:
        with self._lock:
            s = self._sessions.get(session_id)
            return None if s is None else s.model_copy(deep=True)

    def all(self) -> list[SessionSummary]:
        with self._lock:
            return [s.model_copy(deep=True) for s in self._sessions.values()]

    def drop(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)
