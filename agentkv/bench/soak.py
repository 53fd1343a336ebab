"""Soak of an agentkv server over HTTP: many multi-turn sessions at once, mixed policies,
streamed and plain turns, abandoned streams, ended sessions, then an admin flush.

Pass criteria (:attr:`SoakReport.ok`): no unexpected HTTP status or exception, and after every
session ended and the flush, the pool's free slots are back to its capacity. The caller may
check more where it holds the engine (store invariants, RSS): ``benchmarks/soak.py`` does.

Client side only (httpx): it runs against any ``agentkv serve``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

#: wire policies the sessions cycle through
POLICIES: list[dict[str, Any]] = [
    {"method": "full"},
    {"method": "intentkv", "budget": 24},
    {"method": "snapkv", "budget": 24},
    {"method": "streamingllm", "budget": 24, "sinks": 4},
    {"method": "h2o", "budget": 24},
]
TOPICS = ["cats", "rivers", "trains", "apples", "stars", "bread", "music", "snow", "tea", "maps"]
FOLLOW_UPS = ["Why?", "Say more.", "And then?", "Briefly, how?"]


@dataclass
class SoakConfig:
    """One soak run.

    Attributes:
        sessions: multi-turn sessions to run.
        concurrency: sessions in flight at once.
        turns: requests per session.
        max_tokens: tokens per answer.
        abandon_every: every n-th session abandons one streamed turn after its first chunk
            (0: never).
        keep_every: every n-th session is not ended with DELETE (the flush must clean it; 0:
            every session is ended).
        api_key: bearer key of the tenant (``None``: no auth).
        admin_api_key: key for the final flush (``None``: the server's flush is open).
        seed: picks streamed turns.
    """

    sessions: int = 1000
    concurrency: int = 8
    turns: int = 3
    max_tokens: int = 4
    abandon_every: int = 5
    keep_every: int = 7
    api_key: str | None = None
    admin_api_key: str | None = None
    seed: int = 0


@dataclass
class SoakReport:
    config: dict[str, Any]
    requests: int = 0
    abandoned: int = 0
    sessions_ended: int = 0
    errors: list[str] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    flush: dict[str, Any] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and self.flush.get("free_slots") == self.flush.get("capacity")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _headers(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def _session(
    c: httpx.AsyncClient, i: int, cfg: SoakConfig, tag: str, rng: random.Random, report: SoakReport
) -> None:
    sid = f"soak-{tag}-{i}"
    policy = POLICIES[i % len(POLICIES)]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"Session {i}. Be brief."},
        {"role": "user", "content": f"One fact about {TOPICS[i % len(TOPICS)]}."},
    ]
    payload = {"version": 1, "session_id": sid, "policy": policy, "node": f"node{i % 3}"}
    abandon_turn = (
        rng.randrange(cfg.turns) if cfg.abandon_every and i % cfg.abandon_every == 0 else -1
    )
    statuses: Counter[str] = Counter()
    for turn in range(cfg.turns):
        body = {
            "model": "m",
            "messages": messages,
            "max_tokens": cfg.max_tokens,
            "custom_params": {"agentkv": json.dumps(payload)},
        }
        stream = turn == abandon_turn or rng.random() < 0.3
        report.requests += 1
        if stream:
            async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                statuses[str(r.status_code)] += 1
                if r.status_code != 200:
                    report.errors.append(f"{sid} turn {turn}: HTTP {r.status_code}")
                    break
                text = []
                async for line in r.aiter_lines():
                    if turn == abandon_turn:  # walk away after the first chunk
                        report.abandoned += 1
                        break
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            report.errors.append(f"{sid} turn {turn}: {chunk['error']}")
                        for ch in chunk.get("choices", []):
                            text.append(ch["delta"].get("content") or "")
            if turn == abandon_turn:
                break  # an abandoned session sends nothing more
            content = "".join(text)
        else:
            r = await c.post("/v1/chat/completions", json=body)
            statuses[str(r.status_code)] += 1
            if r.status_code != 200:
                report.errors.append(f"{sid} turn {turn}: HTTP {r.status_code} {r.text[:200]}")
                break
            content = r.json()["choices"][0]["message"]["content"] or ""
        messages = [
            *messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]},
        ]
    if not (cfg.keep_every and i % cfg.keep_every == 0):
        r = await c.delete(f"/v1/agentkv/sessions/{sid}")
        statuses[f"DELETE {r.status_code}"] += 1
        # an abandoned first turn may have been cancelled before it ran: 404 is fine then
        if r.status_code != 200 and not (r.status_code == 404 and abandon_turn == 0):
            report.errors.append(f"{sid}: DELETE -> HTTP {r.status_code}")
        report.sessions_ended += 1
    for k, v in statuses.items():
        report.statuses[k] = report.statuses.get(k, 0) + v


async def run_soak_async(
    base_url: str,
    cfg: SoakConfig,
    on_progress: Callable[[int, SoakReport], None] | None = None,
    progress_every: int = 50,
) -> SoakReport:
    """Run the soak against ``base_url`` (the server root, e.g. ``http://127.0.0.1:8000``).
    ``on_progress(done_sessions, report)`` is called every ``progress_every`` sessions."""
    report = SoakReport(config=asdict(cfg) | {"api_key": bool(cfg.api_key)})
    report.config["admin_api_key"] = bool(cfg.admin_api_key)
    rng = random.Random(cfg.seed)
    tag = f"{int(time.time() * 1000) % 10**8}"
    sem = asyncio.Semaphore(cfg.concurrency)
    done = 0
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(
        base_url=base_url, headers=_headers(cfg.api_key), timeout=600, limits=limits
    ) as c:

        async def one(i: int) -> None:
            nonlocal done
            async with sem:
                try:
                    await _session(c, i, cfg, tag, random.Random(rng.random() + i), report)
                except Exception as e:  # a broken connection, a timeout: an error, go on
                    report.errors.append(f"session {i}: {type(e).__name__}: {e}")
            done += 1
            if on_progress is not None and done % progress_every == 0:
                on_progress(done, report)

        await asyncio.gather(*(one(i) for i in range(cfg.sessions)))
        r = await c.post("/v1/agentkv/flush", headers=_headers(cfg.admin_api_key))
        if r.status_code != 200:
            report.errors.append(f"flush -> HTTP {r.status_code} {r.text[:200]}")
        else:
            report.flush = r.json()
    report.wall_s = round(time.perf_counter() - t0, 2)
    return report


def run_soak(base_url: str, cfg: SoakConfig, **kw: Any) -> SoakReport:
    """Blocking :func:`run_soak_async`."""
    return asyncio.run(run_soak_async(base_url, cfg, **kw))
