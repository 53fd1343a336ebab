"""Predict ``sglang_plugin.py capacity`` on the CPU: SGLang's real pools, allocator and radix
cache (stock, or the plugin's) driven by a model of SGLang's scheduler, on the same sessions,
tokenisation and tags the GPU phase sends.

    .venv-sglang/bin/python -P benchmarks/sglang_capacity_predict.py \\
        --policies stock,intentkv:budget=512 --max-turns 4 --pool 32768 --out DIR

For each policy and a level ``L``: ``L`` sessions (tau-bench trajectories ``i % 200`` of
``load_tau_bench(seed=0)``, as ``capacity`` picks them) send their first ``--max-turns``
assistant turns one after another (``max_tokens`` 64, ``ignore_eos``), all sessions at once.
The prompts are SGLang's (its chat-template path: ``content: None`` -> ``""``, tool-call
arguments parsed, :func:`sglang_prompt_ids`) and the tags the plugin's HTTP hook
(``tag_chat_request``) attaches, or none where its render differs from SGLang's ids (the
request then runs untagged on the server too).

What runs for real (SGLang 0.5.17 classes, ``--page-size 1``): ``ReqToTokenPool``,
``TokenToKVPoolAllocator`` / the plugin's ``RefCountedTokenAllocator`` (with its DEAD slot),
``RadixCache`` / the plugin's ``AgentKVRadixCache`` (session namespaces, holey inserts,
reuse caps, physical evictable size), ``Req.init_next_round_input`` (prefix match),
``alloc_token_slots`` (LRU eviction when short), ``cache_unfinished_req`` after each prefill,
``release_kv_cache`` at the end, the plugin's ``apply_evictions`` / ``plan_one``.

What is modelled (:class:`Scheduler`), after SGLang 0.5.17's scheduler with default H100
settings: FCFS waiting queue; a prefill batch whenever one can be formed, else one decode step
(no mixed chunks, no overlap); the ``PrefillAdder`` budget (``rem_total`` = available +
evictable - sum over running requests of ``(max_new - generated) * new_token_ratio``; a request
needs ``extend + max_new + 1 < rem_total``; ``--chunk`` 8192 prefill tokens per batch, one
chunked request at a time); ``new_token_ratio`` from 0.7, decaying by ``(0.7 - 0.098) / 600`` a
decode step, reset to 0.7 whenever the scheduler idles (nothing running or waiting: the
clients' next turns are a round trip away; ``on_idle``); SGLang's ``batch_is_full`` latch: once
the adder stops on NO_TOKEN, no prefill is tried until the running batch loses a request (a
finish or a retraction, at the next decode step's filter) or a batch with an unfinished chunk
is merged, except where the running batch was empty (``get_next_batch_to_run`` replaces it by
the extend batch, whose flag is False: the adder runs again at the next step); the plugin's
latch release (its default, ``AGENTKV_SGLANG_RELEASE_LATCH``; ``--no-release-latch`` models
it off): after the plans of a NO_TOKEN batch freed slots, the flag is cleared and the adder
runs again at the next step with the freed room (stock plans nothing: unaffected). Requests
left waiting by a NO_TOKEN batch that is retried so are counted as queued after the next
adder pass (the overlap scheduler logs a prefill batch's ``#queue-req`` once the next batch
is formed); ``check_decode_mem`` (available + evictable >= running requests) before each decode step, else
a retraction. The first output token comes with the prefill, so a request finishes after 63
decode steps; its session's next turn enters the queue ``--client-delay`` scheduler steps
later. Times are not modelled (one scheduler step = one batch; a turn's requests arrive
together, where the server's trickle in through its tokenizer). ``--session8-model``: without
the latch and the idle reset (Session 8's prediction, which admitted and then retracted where
the server queued).

    .venv-sglang/bin/python -P benchmarks/sglang_capacity_predict.py --bisect \
        --criterion no-queue,no-retraction [--no-release-latch] --out DIR

Plans: ``streamingllm`` runs its real ``plan_one``; ``full`` plans nothing. IntentKV needs
the model's attention; how many positions go depends only on the tags, the live count and the
budget (IntentKV ``budget_scope="total"``: the request keeps ``max(B, |forced|)`` live
positions, ``"history"``: ``|forced| + B``), so the counts are exact; *which* non-forced
positions survive is a stand-in (``--keep``: ``random``, seeded, the default, as scores on
dummy weights are; ``recent``: the latest; ``oldest``: the earliest, mostly the shared system
block: the fewest slots of its own, a lower bound). That choice matters only where ``B > |forced|``
(untagged requests: forced set empty), through what the kept positions share with the tree.
SnapKV / H2O are not predicted: on SGLang a slot goes only where no (layer, head) keeps the
position, so their count is the union of per-head top-k sets, which depends on the scores.

A level holds as in ``capacity --criterion`` (``sglang_plugin.level_holds``): ``no-queue`` (the
default): no request retracted, all ``L`` sessions ran at once (peak running requests = ``L``)
and none ever waited for memory (``peak_queue`` 0: the requests left waiting after the adder
stopped on NO_TOKEN or was latched, what the server log shows as ``#queue-req``; requests that
wait only for the next 8192-token chunk, an artefact of the simultaneous arrivals, are not
counted); ``no-retraction``: without the queue condition. ``--criterion a,b`` predicts each
(each level simulated once). Reported per level: peak ``#token`` (SGLang's ``max_total -
available - evictable``) over all decode steps and over every 40th (what the server log
samples), per session; max running; peak queue; retractions; whether it holds under each
criterion; requests planned and evicted. The predicted capacity is the largest holding level
(bisection between the last holding and the first failing level, or ``--hi``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

for _op in ("nms", "qnms"):  # PyPI's torchvision on CPU torch (as tests/integrations/sglang)
    with contextlib.suppress(RuntimeError):
        torch.library.define(
            f"torchvision::{_op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_plugin import CRITERIA, level_holds, print_table  # noqa: E402

#: SGLang 0.5.17 defaults (environ.py, server_args.py for an 80 GB GPU)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.7 * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
DECODE_LOG_INTERVAL = 40
#: token ids for generated tokens: past Qwen3's text vocabulary, never in a prompt
OUTPUT_ID_BASE = 151_700


@dataclass
class Turn:
    """One request: SGLang's prompt ids and ``custom_params`` (None: no payload)."""

    ids: list[int]
    custom: dict[str, Any] | None = None


# ---- the same requests as the GPU phase ----------------------------------------------------


def sglang_prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The prompt ids SGLang 0.5.17's chat endpoint builds for ``body`` (no tools): messages
    dumped from its pydantic request, ``content: None`` -> ``""``, assistant tool-call
    arguments parsed to objects (``normalize_assistant_tool_call_arguments``), then the
    tokenizer's chat template with the generation prompt."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
    )

    req = ChatCompletionRequest(**body)
    msgs = [m.model_dump() for m in req.messages]
    for m in msgs:
        normalize_assistant_tool_call_arguments(m, strict=False)
        if m.get("content") is None:
            m["content"] = ""
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def tagged_custom(
    tokenizer: Any, body: dict[str, Any], ids: list[int], session7_tags: bool = False
) -> dict[str, Any]:
    """``custom_params`` as the scheduler receives them: the plugin's HTTP hook
    (``tag_chat_request``) run on SGLang's request types over ``ids``. ``session7_tags``: as
    the hook of the Session 7 measurement did, which rendered the client's tool-call argument
    strings (``{"k":"v"}``) where SGLang's prompt has them re-serialised (``{"k": "v"}``):
    such requests ran untagged."""
    from types import SimpleNamespace

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput

    from agentkv.integrations.sglang.request_plan import TAGS_KEY, WIRE_KEY
    from agentkv.integrations.sglang.runtime import tag_chat_request

    request = ChatCompletionRequest(**body)
    adapted = GenerateReqInput(
        input_ids=list(ids), sampling_params={"custom_params": dict(request.custom_params)}
    )
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer))
    tag_chat_request((adapted, request), serving, request)
    custom = adapted.sampling_params["custom_params"]
    if session7_tags and TAGS_KEY in custom:
        from agentkv.engine.chat_template import ChatRenderer
        from agentkv.wire import decode_payload

        renderer = ChatRenderer(tokenizer, template=tokenizer.chat_template)
        msgs = [m.model_dump(exclude_none=True) for m in request.messages]
        annotations = decode_payload(custom[WIRE_KEY]).messages
        if renderer.encode(msgs, tools=None, annotations=annotations).token_ids != ids:
            del custom[TAGS_KEY]
    return custom


def tau_sessions(
    tokenizer: Any,
    spec: str,
    level: int,
    max_turns: int,
    max_tokens: int,
    cache: dict,
    session7_tags: bool = False,
) -> list[list[Turn]]:
    """``level`` sessions as ``capacity`` sends them (trajectory ``i % len(pool)``, session id
    ``cap<level>-<run>-<i>``). ``cache``: per (trajectory, policy) ids and tags (the tags do
    not depend on the session id; the payload does, and is rebuilt)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sglang_plugin import session_requests

    from agentkv.bench.traces import load_tau_bench
    from agentkv.policies import parse_policy
    from agentkv.wire import build_payload, encode_payload

    if "pool" not in cache:
        cache["pool"] = load_tau_bench(seed=0)
    pool = cache["pool"]
    policy = None if spec in ("stock", "nopayload") else parse_policy(spec)
    sessions = []
    for i in range(level):
        trace = pool[i % len(pool)]
        sid = f"cap{level}-{spec}-{i}"
        turns = []
        bodies = session_requests(trace, policy, sid, max_tokens, False, max_turns)
        for k, body in enumerate(bodies):
            key = (i % len(pool), k, spec)
            if key not in cache:
                ids = sglang_prompt_ids(tokenizer, body)
                custom = (
                    tagged_custom(tokenizer, body, ids, session7_tags)
                    if policy is not None
                    else None
                )
                cache[key] = (ids, custom)
                if custom is not None and policy.evicts:  # the plugin's tags fit SGLang's ids?
                    cache.setdefault("tagged", {})[key] = "agentkv_tags" in custom
            ids, custom = cache[key]
            if custom is not None:
                custom = dict(custom)
                custom["agentkv"] = encode_payload(build_payload(body["messages"], policy, sid))
            turns.append(Turn(ids, custom))
        sessions.append(turns)
    return sessions


def publish_context() -> None:
    """SGLang's process-wide config (``runtime_context.publish``) for a Qwen3 model dir with
    only a config.json, as tests/integrations/sglang/conftest.py does (``Req`` reads it)."""
    import os
    import tempfile

    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    d = Path(tempfile.mkdtemp(prefix="qwen3-config-"))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 8,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "vocab_size": 151936,
    }
    (d / "config.json").write_text(json.dumps(config))
    publish(ServerArgs(model_path=str(d), page_size=1, device="cpu"), role="test")


# ---- plans -----------------------------------------------------------------------------------


def stand_in_plan(planner: Any, r2t: Any, alloc: Any, req: Any, state: Any, keep: str) -> int:
    """IntentKV without a model: the method's own counts (forced set from the
    tags, live positions from the row, the budget), the surviving non-forced positions by the
    ``keep`` stand-in; applied as ``plan_one`` applies a plan (``apply_evictions``, the HOLEY
    mark, ``state.planned``). Returns the positions made DEAD."""
    from agentkv.integrations.sglang.request_plan import HOLEY, apply_evictions

    policy = state.payload.policy
    method = planner.methods.for_policy(policy)
    T = len(state.tags)
    row = r2t.req_to_token[req.req_pool_idx, :T].to(torch.int64)
    live = row != alloc.dead_slot
    forced = torch.tensor(state.tags.forced(method.protects_system(policy)), dtype=torch.bool)
    cand = live & ~forced
    n_live, n_cand = int(live.sum()), int(cand.sum())
    budget = int(policy.budget)
    if getattr(policy, "budget_scope", "total") == "history":
        keep_n = budget if n_cand > budget else n_cand
    else:
        keep_n = max(budget - (n_live - n_cand), 0) if n_live > budget else n_cand
    pos = torch.nonzero(cand).reshape(-1)
    if keep == "recent":
        kept = pos[len(pos) - keep_n :] if keep_n else pos[:0]
    elif keep == "oldest":
        kept = pos[:keep_n]
    else:  # random, seeded by the prompt (the same prompt keeps the same positions)
        seed = int.from_bytes(hashlib.blake2b(bytes(array("q", req.origin_input_ids))).digest()[:4])
        g = torch.Generator().manual_seed(seed)
        kept = pos[torch.randperm(len(pos), generator=g)[:keep_n]]
    evict = cand.clone()
    evict[kept] = False
    positions = torch.nonzero(evict).reshape(-1)
    n, freed = apply_evictions(
        r2t.req_to_token, req.req_pool_idx, positions, req.cache_protected_len, alloc, live=live
    )
    if n or not bool(live.all()):
        HOLEY.mark(state)
    state.planned = True
    state.usage = {
        "evicted_tokens": n,
        "freed_slots": freed,
        "live_kv_tokens": n_live - n,
    }
    return n


# ---- the scheduler model ------------------------------------------------------------------


@dataclass
class Running:
    req: Any
    session: int
    turn: int
    max_new: int


@dataclass
class Result:
    level: int
    holds: bool = False
    retractions: int = 0
    peak_queue: int = 0
    oom: bool = False
    stuck: bool = False
    max_running: int = 0
    peak_tokens: int = 0
    peak_tokens_logged: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    planned: int = 0
    evicted: int = 0
    latch_releases: int = 0
    steps: int = 0
    decode_steps: int = 0
    seconds: float = 0.0
    tokens_at_full: list[int] = field(default_factory=list)

    def holds_under(self, criterion: str) -> bool:
        """``sglang_plugin.level_holds`` on this run (an OOM crash or a stuck queue fails)."""
        return not (self.oom or self.stuck) and level_holds(
            criterion,
            self.level,
            retractions=self.retractions,
            peak_running=self.max_running,
            peak_queue=self.peak_queue,
        )

    def row(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "tokens_at_full"}
        for c in CRITERIA:
            d[f"holds_{c.replace('-', '_')}"] = self.holds_under(c)
        d["peak_tokens_per_session"] = round(self.peak_tokens / self.level, 1)
        d["peak_logged_per_session"] = round(self.peak_tokens_logged / self.level, 1)
        full = self.tokens_at_full
        d["mean_tokens_per_session_all_running"] = (
            round(sum(full) / len(full) / self.level, 1) if full else None
        )
        return d


class Scheduler:
    """SGLang's memory objects (stock or the plugin's) and a model of its scheduler loop."""

    def __init__(
        self,
        plugin: bool,
        pool: int,
        rows: int,
        max_ctx: int,
        chunk: int = 8192,
        keep: str = "random",
        client_delay: int = 1,
        criterion: str = "no-queue",
    ):
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        from agentkv.integrations.sglang.radix_cache import AgentKVRadixCache
        from agentkv.integrations.sglang.runtime import Planner
        from agentkv.integrations.sglang.slot_refcounts import RefCountedTokenAllocator
        from agentkv.methods.base import ModelShape

        self.plugin, self.pool, self.chunk = plugin, pool, chunk
        self.keep, self.client_delay, self.criterion = keep, client_delay, criterion
        #: per batch (when not None): what SGLang's log line reports, to compare with a log
        self.trace: list[dict[str, Any]] | None = None
        #: model SGLang's batch_is_full latch (no prefill tried after a NO_TOKEN until the
        #: running batch shrinks) and on_idle()'s reset of new_token_ratio; False: the model
        #: of Session 8's prediction (a prefill tried at every step, the ratio never reset)
        self.latch = True
        self.idle_reset = True
        #: the plugin's latch release (``AGENTKV_SGLANG_RELEASE_LATCH``, default on): after a
        #: prefill batch's plans freed slots, ``batch_is_full`` is cleared (False: SGLang's
        #: latch kept, ``AGENTKV_SGLANG_RELEASE_LATCH=0``)
        self.release_latch = True
        self.r2t = ReqToTokenPool(
            size=rows, max_context_len=max_ctx, device="cpu", enable_memory_saver=False
        )
        # one layer, one head of dim 1: the slot accounting is SGLang's, the bytes are not
        kv = MHATokenToKVPool(
            size=pool,
            page_size=1,
            dtype=torch.float16,
            head_num=1,
            head_dim=1,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        cls = RefCountedTokenAllocator if plugin else TokenToKVPoolAllocator
        self.alloc = cls(pool, torch.float16, "cpu", kv, need_sort=False)
        # the Qwen3-8B shape (what the IntentKV reuse cap and checks read)
        self.planner = Planner(ModelShape(36, 32, 8, 128), 2 * 36 * 8 * 128 * 2)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.alloc,
            page_size=1,
        )
        self.cache = (
            AgentKVRadixCache(params, methods=self.planner.methods)
            if plugin
            else RadixCache(params)
        )

    def _rem_total(self, offset: float) -> float:
        """The adder's ``rem_total_tokens``, read again after each lock as SGLang does."""
        return self.alloc.available_size() + self.cache.evictable_size() - offset

    def used(self) -> int:
        """SGLang's ``#token``: ``max_total - (available + evictable)``."""
        return self.pool - (self.alloc.available_size() + self.cache.evictable_size())

    # ---- one request's steps (as tests/integrations/sglang/conftest.py Steps) --------------

    def _new_req(self, turn: Turn, rid: str, max_new: int) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, custom_params=turn.custom)
        req = Req(rid, "", array("q", turn.ids), sp)
        req.init_next_round_input(self.cache)
        return req

    def _extend(self, req: Any, end: int) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        pre = len(req.prefix_indices)
        req.set_extend_range(pre, end)
        if req.req_pool_idx is None:
            assert self.r2t.alloc([req]) is not None, "req_to_token rows"
        locs = alloc_token_slots(self.cache, end - pre)
        row = req.req_pool_idx
        self.r2t.write((row, slice(0, pre)), req.prefix_indices.to(torch.int32))
        self.r2t.write((row, slice(pre, end)), locs.to(torch.int32))
        if req.kv is None:
            req.kv = ReqKvInfo(kv_allocated_len=end, swa_evicted_seqlen=0)
        req.kv.kv_allocated_len = end
        req.kv_committed_len = end

    def _after_prompt(self, req: Any, res: Result) -> int:
        """The plan (plugin, evicting policy), then SGLang's post-prefill insert. Returns the
        slots the plan freed (the request's own: ``usage["freed_slots"]``)."""
        from agentkv.integrations.sglang.request_plan import request_state
        from agentkv.integrations.sglang.runtime import plan_one

        state = request_state(req) if self.plugin else None
        if state is not None and state.evicts:
            method = state.payload.policy.method
            if method == "streamingllm":
                n = plan_one(self.planner, self.r2t, self.alloc, req, state)
            elif method != "intentkv":
                raise SystemExit(f"{method}: no stand-in (its SGLang count is score-dependent)")
            else:
                n = stand_in_plan(self.planner, self.r2t, self.alloc, req, state, self.keep)
            res.planned += 1
            res.evicted += n
            self.cache.cache_unfinished_req(req)
            return int(state.usage["freed_slots"])
        if state is not None:
            state.planned = True
        self.cache.cache_unfinished_req(req)
        return 0

    def _output_id(self, req: Any) -> int:
        # deterministic per prompt and step (greedy on the same weights: the same prompt
        # gives the same output), never a prompt token
        h = hashlib.blake2b(bytes(array("q", req.origin_input_ids[-64:])), digest_size=2).digest()
        return OUTPUT_ID_BASE + (int.from_bytes(h) + len(req.output_ids)) % 200

    def _finish(self, req: Any) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        self.alloc.free_group_begin()
        release_kv_cache(req, self.cache, is_insert=True)
        self.alloc.free_group_end()

    # ---- the loop --------------------------------------------------------------------------

    def run(self, sessions: list[list[Turn]], max_new: int, stop_at_retract: bool = True) -> Result:
        t0 = time.perf_counter()
        L = len(sessions)
        res = Result(level=L)
        waiting: deque[tuple[int, int, Any]] = deque()  # (session, turn, Req)
        arrivals: list[tuple[int, int, int]] = [(0, s, 0) for s in range(L)]  # (step, s, turn)
        running: list[Running] = []
        chunked: tuple[Running, int] | None = None  # (request, prompt tokens done)
        ratio = INIT_NEW_TOKEN_RATIO
        # SGLang's running_batch.batch_is_full: set when the adder stops on NO_TOKEN; no
        # prefill is tried while it is set, until the running batch loses a request (a finish
        # or a retraction, seen at the next decode step's filter) or a prefill batch with an
        # unfinished chunk is merged
        full = False
        shrunk = False  # a request finished since the last decode step
        done = 0
        step = 0
        while done < L:
            step += 1
            due = [a for a in arrivals if a[0] <= step]
            arrivals = [a for a in arrivals if a[0] > step]
            for _, s, k in sorted(due, key=lambda a: a[1]):
                turn = sessions[s][k]
                waiting.append((s, k, None))
                res.requests += 1
                res.prompt_tokens += len(turn.ids)
            # ---- a prefill batch (PrefillAdder) ----
            batch: list[tuple[Running, int, int]] = []  # (request, start, end)
            no_token = False
            if (waiting and not (full and self.latch)) or chunked:
                offset = sum((r.max_new - len(r.req.output_ids)) * ratio for r in running)
                rem_chunk = self.chunk
                if chunked is not None:
                    # add_chunked_req: the next chunk, capped by the chunk and total budgets
                    # (the chunk budget alone when the total one is spent: it must go on)
                    r, pre = chunked
                    n = len(r.req.origin_input_ids)
                    room = min(rem_chunk, int(self._rem_total(offset)))
                    end = min(n, pre + (room if room > 0 else rem_chunk))
                    batch.append((r, pre, end))
                    rem_chunk -= end - pre
                    offset += end - pre + 1 + (r.max_new if end == n else 0)
                    chunked = None
                while waiting and rem_chunk > 0 and chunked is None:
                    s, k, _ = waiting[0]
                    rid = f"s{s}t{k}"
                    req = self._new_req(sessions[s][k], rid, max_new)
                    pre = len(req.prefix_indices)
                    extend = len(req.origin_input_ids) - pre
                    if extend + max_new + 1 >= self._rem_total(offset):
                        no_token = True  # NO_TOKEN: it waits
                        break
                    self.cache.inc_lock_ref(req.last_node)  # the adder locks the match
                    # the lock took evictable room: read the budget again
                    if extend + max_new + 1 >= self._rem_total(offset):
                        self.cache.dec_lock_ref(req.last_node)
                        no_token = True
                        break
                    waiting.popleft()
                    res.cached_tokens += pre
                    r = Running(req, s, k, max_new)
                    end = len(req.origin_input_ids) if extend <= rem_chunk else pre + rem_chunk
                    batch.append((r, pre, end))
                    offset += extend + max_new + 1
                    rem_chunk -= end - pre
                    if end < len(req.origin_input_ids):
                        break  # one chunked request per batch
                if no_token:
                    full = True
            if batch:
                try:
                    for r, _, end in batch:
                        self._extend(r.req, end)
                except RuntimeError as e:  # SGLang's "Out of memory" on a prefill: a crash
                    if "Out of memory" not in str(e):
                        raise
                    res.oom = True
                    break
                before = len(running)
                freed = 0
                for r, _, end in batch:
                    if end < len(r.req.origin_input_ids):
                        self.cache.cache_unfinished_req(r.req, chunked=True)
                        chunked = (r, end)
                        full = False  # the merge filters the chunk out: the batch shrank
                        continue
                    freed += self._after_prompt(r.req, res)
                    r.req.output_ids.append(self._output_id(r.req))  # sampled with the prefill
                    running.append(r)
                res.steps += 1
                if no_token and full and before == 0:
                    # get_next_batch_to_run merges the extend batch into an empty running
                    # batch by replacing it: the new running batch's flag is the extend
                    # batch's, False
                    full = False
                elif no_token and full and self.release_latch and freed > 0:
                    # the plugin's release_latch (after_extend): the plans freed slots
                    full = False
                    res.latch_releases += 1
                retry = no_token and self.latch and not full  # the adder runs at the next step
                # they wait for memory (SGLang's log shows them as #queue-req). Retried, they
                # are counted after the next adder pass: the overlap scheduler logs a prefill
                # batch's line once the next batch is formed
                if no_token and not retry:
                    res.peak_queue = max(res.peak_queue, len(waiting))
                if self.trace is not None:
                    self.trace.append(
                        dict(
                            step=step,
                            kind="prefill",
                            new_seq=len(batch),
                            new_token=sum(end - pre for _, pre, end in batch),
                            running=before,
                            queue=len(waiting),
                            no_token=no_token,
                            retry=retry,
                            used=self.used(),
                            ratio=round(ratio, 4),
                        )
                    )
                continue
            if not running:
                if not arrivals:  # nothing can change: stuck (or nothing left)
                    res.stuck = bool(waiting or chunked)
                    break
                continue
            # ---- one decode step ----
            # update_running_batch: the finished requests leave the batch (it shrank: the
            # adder may try again at the next step)
            if shrunk:
                full, shrunk = False, False
            res.decode_steps += 1
            res.max_running = max(res.max_running, len(running))
            res.peak_queue = max(res.peak_queue, len(waiting))  # they wait for memory
            # check_decode_mem: reclaim the shortfall from the tree, then the step fits or not
            from sglang.srt.mem_cache.common import evict_from_tree_cache

            used = self.used()  # #token before the step (the log line's)
            evict_from_tree_cache(self.cache, len(running))
            if self.alloc.available_size() < len(running):
                res.retractions += 1
                if stop_at_retract:
                    break
                # retract the request with the longest output (as SGLang's order, roughly)
                r = max(running, key=lambda x: len(x.req.output_ids))
                running.remove(r)
                self.alloc.free_group_begin()
                from sglang.srt.mem_cache.common import release_kv_cache

                release_kv_cache(r.req, self.cache, is_insert=False)
                self.alloc.free_group_end()
                waiting.appendleft((r.session, r.turn, None))
                ratio = min(1.0, ratio + 0.1)
                full = False
                continue
            res.peak_tokens = max(res.peak_tokens, used)
            if res.decode_steps % DECODE_LOG_INTERVAL == 0:
                res.peak_tokens_logged = max(res.peak_tokens_logged, used)
            if len(running) == L:
                res.tokens_at_full.append(used)
            if self.trace is not None:
                self.trace.append(
                    dict(
                        step=step,
                        kind="decode",
                        running=len(running),
                        queue=len(waiting),
                        used=used,
                        ratio=round(ratio, 4),
                    )
                )
            from sglang.srt.mem_cache.allocation import alloc_token_slots

            locs = alloc_token_slots(self.cache, len(running)).to(torch.int32)
            rows = torch.tensor([r.req.req_pool_idx for r in running])
            cols = torch.tensor([r.req.kv_committed_len for r in running])
            self.r2t.req_to_token[rows, cols] = locs
            still = []
            for r in running:
                r.req.kv_committed_len += 1
                r.req.kv.kv_allocated_len += 1
                r.req.output_ids.append(self._output_id(r.req))
                if len(r.req.output_ids) >= r.max_new:
                    self._finish(r.req)
                    shrunk = True
                    if r.turn + 1 < len(sessions[r.session]):
                        arrivals.append((step + self.client_delay, r.session, r.turn + 1))
                    else:
                        done += 1
                else:
                    still.append(r)
            running = still
            ratio = max(MIN_NEW_TOKEN_RATIO, ratio - NEW_TOKEN_RATIO_DECAY)
            if not running:
                # the clients answer after a round trip: the scheduler loops without a batch
                # meanwhile, its filter empties the running batch (batch_is_full = False) and,
                # with nothing waiting, on_idle() resets the ratio
                full = shrunk = False
                if self.idle_reset and not waiting and chunked is None:
                    ratio = INIT_NEW_TOKEN_RATIO
            res.steps += 1
        res.holds = res.holds_under(self.criterion)
        res.seconds = round(time.perf_counter() - t0, 2)
        return res


def simulate(
    sessions: list[list[Turn]],
    plugin: bool,
    pool: int,
    max_new: int = 64,
    chunk: int = 8192,
    keep: str = "random",
    client_delay: int = 1,
    criterion: str = "no-queue",
    sglang_admission: bool = True,
    release_latch: bool = True,
) -> Result:
    """One level: ``sessions`` (each a list of turns) all at once on a fresh pool.
    ``sglang_admission`` False: without the ``batch_is_full`` latch and the idle ratio reset
    (the model of Session 8's prediction). ``release_latch``: the plugin's latch release
    (its default, on; False: ``AGENTKV_SGLANG_RELEASE_LATCH=0``)."""
    from sglang.srt.runtime_context import get_serving

    from agentkv.integrations.sglang.request_plan import HOLEY

    try:
        get_serving()
    except ValueError:  # not published yet (a test session publishes its own)
        publish_context()
    HOLEY.count = 0
    max_ctx = max(len(t.ids) for s in sessions for t in s) + max_new + 8
    sched = Scheduler(
        plugin, pool, len(sessions) + 4, max_ctx, chunk, keep, client_delay, criterion
    )
    sched.latch = sched.idle_reset = sglang_admission
    sched.release_latch = release_latch
    return sched.run(sessions, max_new)


# ---- the command -----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="stock,intentkv:budget=512")
    ap.add_argument("--levels", default="16,32,48,64,96,128,192,256", help="levels to report")
    ap.add_argument("--bisect", action="store_true", help="also bisect the max holding level")
    ap.add_argument("--hi", type=int, default=512, help="bisection: a level assumed to fail")
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pool", type=int, default=32768, help="--max-total-tokens of the servers")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill size (H100: 8192)")
    ap.add_argument("--keep", choices=["random", "recent", "oldest"], default="random")
    ap.add_argument("--client-delay", type=int, default=1, help="scheduler steps between turns")
    ap.add_argument(
        "--criterion",
        default="no-queue",
        help="what holds means, as sglang_plugin.py capacity --criterion: no-queue (no "
        "retraction, all sessions running at once, no request ever waiting for memory) or "
        "no-retraction; a comma list predicts each (levels simulated once)",
    )
    ap.add_argument(
        "--session8-model",
        action="store_true",
        help="the scheduler model of Session 8's prediction: a prefill tried at every step "
        "(no batch_is_full latch), new_token_ratio never reset when idle",
    )
    ap.add_argument(
        "--no-release-latch",
        action="store_true",
        help="the plugin with AGENTKV_SGLANG_RELEASE_LATCH=0: SGLang's batch_is_full kept "
        "after a plan frees slots (the plugin's default releases it; stock never plans)",
    )
    ap.add_argument(
        "--session7-tags",
        action="store_true",
        help="tag as the plugin did in the Session 7 measurement (tool-call histories untagged)",
    )
    ap.add_argument("--tokenizer", default="/work/shared/data/qwen3-tokenizer")
    ap.add_argument("--out", default="/tmp/out")
    a = ap.parse_args()
    criteria = a.criterion.split(",")
    for c in criteria:
        if c not in CRITERIA:
            ap.error(f"--criterion {c}: one of {', '.join(CRITERIA)}")
    import logging

    logging.getLogger("agentkv").setLevel(logging.WARNING)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache: dict = {}
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}

    done: dict[tuple[str, int], Result] = {}

    def level(spec: str, n: int) -> Result:
        if (spec, n) in done:
            return done[spec, n]
        sessions = tau_sessions(tok, spec, n, a.max_turns, a.max_tokens, cache, a.session7_tags)
        r = simulate(
            sessions,
            spec != "stock",
            a.pool,
            a.max_tokens,
            a.chunk,
            a.keep,
            a.client_delay,
            criteria[0],
            not a.session8_model,
            not a.no_release_latch,
        )
        done[spec, n] = r
        row = {"run": spec, **r.row()}
        rows.append(row)
        verdicts = " ".join(f"{c}={r.holds_under(c)}" for c in CRITERIA)
        print(
            f"{spec} L={n}: {verdicts} retracted={r.retractions} running={r.max_running} "
            f"queue={r.peak_queue} peak #token={r.peak_tokens} "
            f"({row['peak_tokens_per_session']}/session; logged "
            f"{row['peak_logged_per_session']}) planned={r.planned} evicted={r.evicted} "
            f"releases={r.latch_releases} "
            f"prompt={r.prompt_tokens} cached={r.cached_tokens} ({r.seconds}s)",
            flush=True,
        )
        return r

    for spec in a.policies.split(","):
        summary[spec] = {}
        for crit in criteria:
            held, failed = 0, None
            for n in [int(x) for x in a.levels.split(",")]:
                if level(spec, n).holds_under(crit):
                    held = n
                else:
                    failed = n
                    break
            if a.bisect:
                lo, hi = held, failed or a.hi
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if level(spec, mid).holds_under(crit):
                        lo = mid
                    else:
                        hi = mid
                held, failed = lo, hi
            summary[spec][crit] = {"max_level_held": held, "first_failing": failed}
            print(f"{spec}: predicted max concurrent sessions ({crit}) {held} (fails at {failed})")
        tagged = [v for k, v in cache.get("tagged", {}).items() if k[2] == spec]
        if tagged:
            summary[spec]["distinct_prompts_tagged"] = f"{sum(tagged)}/{len(tagged)}"
            print(f"{spec}: {sum(tagged)} of {len(tagged)} distinct prompts tagged (else untagged)")
    res = {
        "pool": a.pool,
        "max_turns": a.max_turns,
        "max_tokens": a.max_tokens,
        "chunk": a.chunk,
        "keep": a.keep,
        "session7_tags": a.session7_tags,
        "client_delay": a.client_delay,
        "criteria": criteria,
        "scheduler_model": "session8" if a.session8_model else "sglang-0.5.17",
        "release_latch": not a.no_release_latch,
        "summary": summary,
        "rows": rows,
    }
    (out / "capacity_predict.json").write_text(json.dumps(res, indent=1))
    cols = [
        "run",
        "level",
        "holds_no_queue",
        "holds_no_retraction",
        "retractions",
        "peak_queue",
        "max_running",
        "peak_tokens",
        "peak_tokens_per_session",
        "peak_logged_per_session",
        "planned",
        "evicted",
        "latch_releases",
        "cached_tokens",
        "prompt_tokens",
    ]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
