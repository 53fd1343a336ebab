"""Where the plugin's host time goes, per SGLang process: seconds and calls per stage.

SGLang's scheduler is one Python thread: every millisecond the plugin spends in its hooks
(observing, synchronising, planning) is a millisecond no batch is prepared, and the
tokenizer process tags every evicting request before SGLang sees it. :data:`HOST_TIME`
accumulates ``perf_counter`` time per stage (``with HOST_TIME.stage("plan"): ...``) and logs
one line per interval on the ``agentkv.sglang`` logger::

    agentkv host time (30.0 s): plan 412.3 ms / 148 = 2.79 ms; sync 95.1 ms / 37 = 2.57 ms; ...

then starts over. CPU time of launches, not GPU time: a stage that queues kernels costs its
launch time here; ``sync`` (waiting for the forward before planning) is the GPU time the
scheduler thread waits. ``AGENTKV_SGLANG_HOST_TIME_S``: the interval in seconds (default
30; ``0`` turns the log off, the counting stays). ``benchmarks/sglang_plugin.py`` sums the
lines of a run (:func:`parse_host_time`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger("agentkv.sglang")

INTERVAL_ENV = "AGENTKV_SGLANG_HOST_TIME_S"
_LINE = re.compile(r"([a-z_]+) ([\d.]+) ms / (\d+) = ")


@dataclass
class StageTime:
    """One stage's host time since the last log line."""

    seconds: float = 0.0
    calls: int = 0


class HostTime:
    """Seconds and calls per stage, logged every ``interval_s`` seconds (see the module)."""

    def __init__(self, interval_s: float | None = None) -> None:
        if interval_s is None:
            interval_s = float(os.environ.get(INTERVAL_ENV, "30"))
        self.interval_s = interval_s
        self.stages: dict[str, StageTime] = {}
        self.since = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        s = self.stages.setdefault(name, StageTime())
        s.seconds += seconds
        s.calls += 1
        if self.interval_s > 0 and time.perf_counter() - self.since >= self.interval_s:
            self.flush()

    def line(self) -> str:
        """``stage T ms / N = t ms; ...``, the costliest stage first."""
        parts = sorted(self.stages.items(), key=lambda kv: -kv[1].seconds)
        return "; ".join(
            f"{k} {1e3 * v.seconds:.1f} ms / {v.calls} = {1e3 * v.seconds / v.calls:.2f} ms"
            for k, v in parts
        )

    def flush(self) -> None:
        """Log the interval's line (if anything was timed) and start over."""
        now = time.perf_counter()
        if self.stages:
            logger.info("agentkv host time (%.1f s): %s", now - self.since, self.line())
        self.stages = {}
        self.since = now


HOST_TIME = HostTime()


def parse_host_time(text: str) -> dict[str, dict[str, float]]:
    """Sum the ``agentkv host time`` lines of a log excerpt: per stage, ``ms`` and ``calls``."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if "agentkv host time" not in line:
            continue
        for name, ms, calls in _LINE.findall(line.split("):", 1)[-1]):
            d = out.setdefault(name, {"ms": 0.0, "calls": 0})
            d["ms"] = round(d["ms"] + float(ms), 1)
            d["calls"] += int(calls)
    return out


def timed(name: str):
    """Decorator: the function's calls count as stage ``name`` of :data:`HOST_TIME`."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with HOST_TIME.stage(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
