"""The entry point under SGLang's own ``load_plugins()`` (a fresh interpreter each: plugins
load once per process and patch SGLang's classes), and the ``Scheduler.run_batch`` hook's
latch release on SGLang's real pools, radix cache and ``ScheduleBatch``."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

PROBE = textwrap.dedent(
    """
    import torch
    for op in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES
    print("attention", "agentkv" in ATTENTION_BACKENDS, "agentkv" in ATTENTION_BACKEND_CHOICES)
    print("radix", "agentkv" in registered_radix_cache_backends())
    def hooked(fn):
        cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
        return any(getattr(c, "__module__", "").startswith("agentkv.") for c in cells)
    print("run_batch", hooked(Scheduler.run_batch))
    print("chat", hooked(OpenAIServingChat._convert_to_internal_request))
    print("usage", all(hooked(getattr(OpenAIServingChat, m)) for m in (
        "_build_chat_response", "_generate_stream_content", "_generate_chat_stream")))
    """
)


def probe(plugins: str | None) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("SGLANG_PLUGINS", None)
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_load_plugins_registers_the_agentkv_backends_and_hooks():
    out = probe("agentkv")
    assert "attention True True" in out
    assert "radix True" in out
    assert "run_batch True" in out
    assert "chat True" in out
    assert "usage True" in out


def test_sglang_plugins_whitelist_leaves_sglang_stock():
    out = probe("someone-else")
    assert "attention False False" in out
    assert "radix False" in out
    assert "run_batch False" in out
    assert "chat False" in out
    assert "usage False" in out


# ---- the run_batch hook: batch_is_full released after a plan frees slots ----------------------


def _payload(session: str, policy=None) -> str:
    from agentkv.policies import FullCache
    from agentkv.wire import KVPayload, encode_payload

    return encode_payload(KVPayload(session_id=session, policy=policy or FullCache()))


def _tokens(n: int, seed: int) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(10, 30000) for _ in range(n)]


@pytest.fixture
def hook(steps, monkeypatch):
    """``run(req, running_reqs, full)``: SGLang's scheduler at ``run_batch`` of an extend batch
    holding ``req`` (admitted, its prompt KV written by the "forward"), with
    ``scheduler.running_batch`` a real ``ScheduleBatch`` of ``running_reqs`` whose
    ``batch_is_full`` is ``full``, run through the plugin's AROUND hook. Returns the scheduler,
    the slots the allocator got back and the change of :data:`LATCH`."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from agentkv.integrations.sglang import runtime

    monkeypatch.setattr(runtime, "_PLANNER", steps.planner)
    monkeypatch.delenv(runtime.RELEASE_LATCH_ENV, raising=False)

    def run(req, running_reqs, full=True):
        scheduler = SimpleNamespace(
            req_to_token_pool=steps.r2t,
            token_to_kv_pool_allocator=steps.alloc,
            model_config=None,  # the planner is the test's (monkeypatched)
            running_batch=ScheduleBatch(reqs=running_reqs, batch_is_full=full),
        )
        batch = ScheduleBatch(reqs=[req], forward_mode=ForwardMode.EXTEND)
        latch0 = (runtime.LATCH.count, runtime.LATCH.slots)
        free = []

        def forward(sched, b):
            assert sched is scheduler and b is batch
            steps.prefill(req, plan=False)  # slots allocated, the row and KV written
            free.append(steps.alloc.available_size())
            return "result"

        assert runtime.run_batch(forward, scheduler, batch) == "result"
        freed = steps.alloc.available_size() - free[0]
        latch = (runtime.LATCH.count - latch0[0], runtime.LATCH.slots - latch0[1])
        steps.cache.cache_unfinished_req(req)  # SGLang's post-prefill insert
        return scheduler, freed, latch

    return run


def test_run_batch_releases_batch_is_full_when_the_plans_free_slots(steps, hook):
    from agentkv.policies import StreamingLLM

    running = steps.request(_tokens(24, 1), _payload("s0"), rid="r0")
    steps.prefill(running)
    req = steps.request(_tokens(40, 2), _payload("s1", StreamingLLM(budget=16, sinks=4)), rid="r1")
    scheduler, freed, latch = hook(req, [running])
    assert freed == 24 == req.agentkv.usage["freed_slots"] == req.agentkv.usage["evicted_tokens"]
    assert scheduler.running_batch.batch_is_full is False
    assert latch == (1, 24)
    for r in (running, req):
        steps.finish(r)
    steps.cache.check_invariants()


def test_run_batch_keeps_batch_is_full_when_nothing_is_freed_or_switched_off(
    steps, hook, monkeypatch
):
    from agentkv.integrations.sglang.runtime import RELEASE_LATCH_ENV
    from agentkv.policies import StreamingLLM

    running = steps.request(_tokens(24, 1), _payload("s0"), rid="r0")
    steps.prefill(running)
    done = []
    # FullCache: no plan
    r = steps.request(_tokens(40, 2), _payload("s1"), rid="a")
    scheduler, freed, latch = hook(r, [running])
    assert freed == 0 and scheduler.running_batch.batch_is_full and latch == (0, 0)
    done.append(r)
    # a budget above the prompt: planned, nothing evicted
    r = steps.request(_tokens(40, 3), _payload("s2", StreamingLLM(budget=64, sinks=4)), rid="b")
    scheduler, freed, latch = hook(r, [running])
    assert r.agentkv.planned and r.agentkv.usage["evicted_tokens"] == 0
    assert freed == 0 and scheduler.running_batch.batch_is_full and latch == (0, 0)
    done.append(r)
    # evicted, but inside the prefix it matched: the tree's slots, nothing freed
    ids = _tokens(40, 4)
    first = steps.request(ids + [5], _payload("x"), rid="x")  # FullCache: caches ids intact
    steps.prefill(first)
    steps.finish(first)
    r = steps.request(ids + [6], _payload("y", StreamingLLM(budget=8, sinks=2)), rid="y")
    scheduler, freed, latch = hook(r, [running])
    assert r.agentkv.usage["evicted_tokens"] == 33  # 41 positions, 8 kept: 40 matched
    assert r.agentkv.usage["freed_slots"] == 0
    assert scheduler.running_batch.batch_is_full and latch == (0, 0)
    done.append(r)
    # an empty running batch: SGLang's merge replaces it by the extend batch (flag False)
    r = steps.request(_tokens(40, 5), _payload("s3", StreamingLLM(budget=16, sinks=4)), rid="c")
    scheduler, freed, latch = hook(r, [])
    assert freed == 24 and scheduler.running_batch.batch_is_full and latch == (0, 0)
    done.append(r)
    # AGENTKV_SGLANG_RELEASE_LATCH=0: SGLang's latch kept although the plan freed slots
    monkeypatch.setenv(RELEASE_LATCH_ENV, "0")
    r = steps.request(_tokens(40, 6), _payload("s4", StreamingLLM(budget=16, sinks=4)), rid="d")
    scheduler, freed, latch = hook(r, [running])
    assert freed == 24 and scheduler.running_batch.batch_is_full and latch == (0, 0)
    done.append(r)
    for r in [running, *done]:
        steps.finish(r)
    steps.cache.check_invariants()


# ---- host time per stage (integrations/sglang/host_time.py) ------------------------------------


def test_host_time_counts_stages_and_logs_a_line_the_benchmark_parses(caplog):
    from agentkv.integrations.sglang.host_time import HostTime, parse_host_time

    ht = HostTime(interval_s=0)  # no automatic line: flushed by hand
    for _ in range(3):
        with ht.stage("plan"):
            sum(range(1000))
    ht.add("sync", 0.004)
    assert ht.stages["plan"].calls == 3 and ht.stages["sync"].seconds == 0.004
    with caplog.at_level(logging.INFO, logger="agentkv.sglang"):
        ht.flush()
        ht.add("sync", 0.006)
        ht.flush()
        ht.flush()  # nothing timed since: no line
    lines = [r.getMessage() for r in caplog.records if "agentkv host time" in r.getMessage()]
    assert len(lines) == 2 and "sync 4.0 ms / 1 = 4.00 ms" in lines[0]
    got = parse_host_time("\n".join(f"[2026-11-23 21:00:00] {x}" for x in lines))
    assert got["sync"] == {"ms": 10.0, "calls": 2} and got["plan"]["calls"] == 3
    assert not ht.stages  # started over


def test_run_batch_times_its_stages(steps, hook, monkeypatch):
    """The hook's stages land in HOST_TIME: the observer's start, the plan (no ``sync`` on
    the CPU: no CUDA stream to wait for)."""
    from agentkv.integrations.sglang.host_time import HOST_TIME
    from agentkv.policies import StreamingLLM

    monkeypatch.setattr(HOST_TIME, "interval_s", 0)  # no line: the counts stay readable
    monkeypatch.setattr(HOST_TIME, "stages", {})
    req = steps.request(_tokens(40, 5), _payload("t", StreamingLLM(budget=16, sinks=4)), rid="t")
    hook(req, [], full=False)
    assert HOST_TIME.stages["before_extend"].calls == 1 and HOST_TIME.stages["plan"].calls == 1
    assert "sync" not in HOST_TIME.stages
    steps.finish(req)
