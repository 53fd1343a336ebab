"""Training rows for IntentKV's residual head: agent sessions replayed through the engine.

Each session is replayed turn by turn (one request per assistant message, its prompt the
messages before it) under an IntentKV policy in memory mode, so the QueryMemory evolves as at
inference and later turns see the holes earlier turns left. Every compression event that
scores is recorded (:class:`agentkv.methods.intentkv.ScoringEvent`) and becomes one row:

- per candidate (live, not forced): the rule score ``s``, the key mean ``k [D]``;
- the memory mean ``m [D]`` and the live actionable-span key means ``q_keys [M, D]``;
- labels (future-action grounding): a candidate is positive (1) when its characters lie in
  a literal occurrence, in the rendered prompt, of an argument value of one of the next
  ``horizon`` tool calls of the session (leaf values of at least ``min_chars`` characters);
  template tokens (``delim``) are excluded (-1); everything else is negative (0). Rows with no
  positive are dropped. This is ``label="arguments"`` (the default).
- ``label="attention"`` (fidelity-aligned, :mod:`agentkv.train.intentkv_attention`): a
  candidate is positive when it is among the top candidates by the attention mass FullCache's
  reference continuation (the next assistant message, teacher-forced) pays it; by default as
  many as the policy keeps. ``label="both"``: the union (positive when either says so;
  every candidate labelled, as in ``attention``).

Sits above the engine layer (it drives an :class:`agentkv.engine.engine.Engine`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.bench.traces import Trace
from agentkv.methods.intentkv import IntentKVMethod, ScoringEvent
from agentkv.policies import IntentKV
from agentkv.tags import Role, TagCode
from agentkv.train.intentkv_attention import AttentionLabeler, attention_labels, kept_by_policy

LABELS = ("arguments", "attention", "both")


@dataclass
class Row:
    """One compression event (float32 tensors, CPU).

    Attributes:
        rule: ``[N]`` rule scores of the candidates (softmax mass over them).
        keys: ``[N, D]`` candidate key means; ``memory``: ``[D]``; ``q_keys``: ``[M, D]``.
        labels: int8 ``[N]``: 1 positive, 0 negative, -1 excluded.
        memory_norm: ``[L, Hq]`` norms of the memory rows (the unit-norm term of the loss).
        session: trace id; ``turn``: message index of the assistant reply.
    """

    rule: torch.Tensor
    keys: torch.Tensor
    memory: torch.Tensor
    q_keys: torch.Tensor
    labels: torch.Tensor
    memory_norm: torch.Tensor
    session: str = ""
    turn: int = 0

    @property
    def positives(self) -> int:
        return int((self.labels == 1).sum())


@dataclass
class DatasetStats:
    sessions: int = 0
    requests: int = 0
    events: int = 0
    rows: int = 0
    candidates: int = 0
    positives: int = 0
    excluded: int = 0
    sources: dict[str, int] = field(default_factory=dict)

    @property
    def positive_rate(self) -> float:
        labelled = self.candidates - self.excluded
        return self.positives / labelled if labelled else 0.0


def argument_values(arguments: Any, min_chars: int = 3) -> list[str]:
    """Leaf values of a tool call's arguments (a JSON string or object) as strings of at least
    ``min_chars`` characters (keys are not values)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return [arguments] if len(arguments.strip()) >= min_chars else []
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, Mapping):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif v is not None and not isinstance(v, bool):
            text = str(v).strip()
            if len(text) >= min_chars:
                out.append(text)

    walk(arguments)
    return out


def future_arguments(
    messages: Sequence[Mapping[str, Any]], start: int, horizon: int = 5, min_chars: int = 3
) -> list[str]:
    """Argument values of the next ``horizon`` tool calls in ``messages[start:]``."""
    values: list[str] = []
    calls = 0
    for m in messages[start:]:
        for call in m.get("tool_calls") or []:
            if calls == horizon:
                return values
            fn = call.get("function") or {}
            values += argument_values(fn.get("arguments", {}), min_chars)
            calls += 1
    return values


def char_labels(text: str, values: Iterable[str]) -> torch.Tensor:
    """bool ``[len(text)]``: characters inside a literal occurrence of any value."""
    mask = torch.zeros(len(text), dtype=torch.bool)
    for v in set(values):
        for m in re.finditer(re.escape(v), text):
            mask[m.start() : m.end()] = True
    return mask


def token_labels(
    text: str,
    offsets: Sequence[tuple[int, int]],
    chars: torch.Tensor,
    candidates: torch.Tensor,
    tag_codes: torch.Tensor,
) -> torch.Tensor:
    """int8 ``[T]`` labels: 1 for a candidate whose characters (surrounding whitespace aside)
    all lie in an occurrence, 0 for other candidates, -1 for template tokens and
    non-candidates."""
    T = len(offsets)
    labels = torch.full((T,), -1, dtype=torch.int8)
    for t in range(T):
        if not bool(candidates[t]) or TagCode.role_of(int(tag_codes[t])) is Role.DELIM:
            continue
        s, e = offsets[t]
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        inside = e > s and bool(chars[s:e].all())
        labels[t] = 1 if inside else 0
    return labels


def collect_rows(
    engine: Any,
    traces: Sequence[Trace],
    policy: IntentKV,
    max_tokens: int = 4096,
    horizon: int = 5,
    min_chars: int = 3,
    progress: bool = True,
    label: str = "arguments",
    labeler: AttentionLabeler | None = None,
    attention_top: float | None = None,
) -> tuple[list[Row], DatasetStats]:
    """Replay ``traces`` through ``engine`` under ``policy`` (memory mode) and label every
    compression event (module docstring).

    ``label`` "attention" and "both" need ``labeler`` (the model in eager attention);
    ``attention_top`` is the positive fraction of the candidates (None: what the policy keeps).
    """
    if label not in LABELS:
        raise ValueError(f"label: one of {', '.join(LABELS)}, got {label!r}")
    if label != "arguments" and labeler is None:
        raise ValueError(f"label: {label!r} needs an AttentionLabeler (eager model)")
    if attention_top is not None and not 0.0 < attention_top <= 1.0:
        raise ValueError(f"attention_top: must be in (0, 1], got {attention_top}")
    from tqdm.auto import tqdm

    from agentkv.bench.replay import assistant_turns, truncate
    from agentkv.engine.engine import GenerationConfig
    from agentkv.wire import build_payload

    if policy.mode != "memory":
        raise ValueError(f"policy.mode: training replays in memory mode, got {policy.mode!r}")
    method = engine.methods.for_policy(policy)
    assert isinstance(method, IntentKVMethod)
    rows: list[Row] = []
    stats = DatasetStats()
    events: list[ScoringEvent] = []
    method.recorder = events.append
    try:
        for trace in tqdm(traces, desc="sessions", unit="session", disable=not progress):
            messages = truncate(engine, trace, max_tokens)
            turns = assistant_turns(messages)
            if not turns:
                continue
            stats.sessions += 1
            stats.sources[trace.source] = stats.sources.get(trace.source, 0) + 1
            sid = f"train/{trace.id}"
            try:
                for i in turns:
                    events.clear()
                    prompt = messages[:i]
                    payload = build_payload(prompt, policy, sid)
                    engine.chat(
                        prompt, trace.tools, payload=payload, gen=GenerationConfig(max_tokens=1)
                    )
                    stats.requests += 1
                    if not events:
                        continue
                    stats.events += 1
                    row = _row(
                        engine, events[-1], trace, messages, i, horizon, min_chars,
                        label, labeler, attention_top,
                    )  # fmt: skip
                    if row is None:
                        continue
                    rows.append(row)
                    stats.rows += 1
                    stats.candidates += int(row.labels.numel())
                    stats.positives += row.positives
                    stats.excluded += int((row.labels < 0).sum())
            finally:
                engine.end_session(sid)
                engine.store.flush_prefix_cache()
    finally:
        method.recorder = None
    return rows, stats


def _row(
    engine: Any,
    event: ScoringEvent,
    trace: Trace,
    messages: Sequence[Mapping[str, Any]],
    turn: int,
    horizon: int,
    min_chars: int,
    label: str = "arguments",
    labeler: AttentionLabeler | None = None,
    attention_top: float | None = None,
) -> Row | None:
    ctx = event.ctx
    tags = engine.renderer.encode(list(messages[:turn]), trace.tools)
    if len(tags) != ctx.seq_len:
        raise RuntimeError(f"{trace.id} turn {turn}: rendering differs from the request's")
    labels = None
    if label in ("arguments", "both"):
        enc = engine.tokenizer(tags.text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        chars = char_labels(tags.text, future_arguments(messages, turn, horizon, min_chars))
        labels = token_labels(tags.text, offsets, chars, event.candidates, ctx.tag_codes)
    if label in ("attention", "both"):
        assert labeler is not None
        full = engine.renderer.encode(
            list(messages[: turn + 1]), trace.tools, add_generation_prompt=False
        )
        n = len(tags)
        if list(full.token_ids[:n]) != list(tags.token_ids) or len(full) <= n:
            raise RuntimeError(f"{trace.id} turn {turn}: the reply does not continue the prompt")
        mass = labeler.continuation_mass(torch.tensor(full.token_ids), n)
        n_cand = int(event.candidates.sum())
        policy = ctx.policy
        if attention_top is None:
            k = kept_by_policy(int(ctx.live.sum()), n_cand, policy.budget, policy.budget_scope)
        else:
            k = max(1, round(attention_top * n_cand))
        att = attention_labels(mass, event.candidates, k)
        labels = att if labels is None else torch.where((att == 1) | (labels == 1), 1, att)
        labels = labels.to(torch.int8)
    assert labels is not None
    idx = torch.nonzero(event.candidates).reshape(-1)
    labels = labels[idx]
    if not bool((labels == 1).any()):
        return None
    live_span = torch.nonzero(ctx.actionable & ctx.live).reshape(-1)
    return Row(
        rule=event.scores[idx].clone(),
        keys=event.key_means[idx].clone(),
        memory=event.probe.mean(dim=(0, 1)).clone(),
        q_keys=event.key_means[live_span].clone(),
        labels=labels,
        memory_norm=event.probe.norm(dim=-1).clone(),
        session=trace.id,
        turn=turn,
    )
