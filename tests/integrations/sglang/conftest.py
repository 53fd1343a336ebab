"""SGLang 0.5.17's real memory classes on CPU, driven the way SGLang's scheduler drives them.

These tests run in the SGLang environment (``.venv-sglang``, ``make setup``): SGLang pins
transformers 5.12.1, the embedded engine needs >= 5.17, so they cannot share one environment.
Elsewhere (no ``sglang``) the directory is not collected.

PyPI's torchvision wheel (SGLang imports ``torchvision.io`` at start-up) is built against CUDA
torch: on CI's CPU torch its C++ ops do not load and its import stops registering fake kernels
for two of them. Declaring those two op schemas first lets it import; no test uses torchvision.
"""

from __future__ import annotations

import contextlib
import importlib.util
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from device_reads import host_read  # tests/ (rootdir conftest dir) is on sys.path
from torch.utils._python_dispatch import TorchDispatchMode

# (this folder is on sys.path as a namespace package named sglang too: no origin)
_spec = importlib.util.find_spec("sglang")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import torch

    for _op in ("nms", "qnms"):
        # RuntimeError: torchvision's own C++ ops loaded (a CUDA machine)
        with contextlib.suppress(RuntimeError):
            torch.library.define(
                f"torchvision::{_op}",
                "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            )


#: a small Qwen3-shaped config: ServerArgs reads the model's config.json.
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "vocab_size": 32000,
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    import json

    d = tmp_path_factory.mktemp("qwen3-tiny")
    (d / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    return d


@pytest.fixture(scope="session", autouse=True)
def sglang_context(model_dir):
    """SGLang's process-wide config (``runtime_context.publish``), as its scheduler has it."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=str(model_dir), page_size=1, device="cpu"), role="test")


@pytest.fixture(autouse=True)
def _between_batches():
    """Every test ends as SGLang's scheduler ends a batch (``run_batch``'s ``finally``): the
    extend batch's rows, host layout and query sums forgotten, so none leaks into the next."""
    yield
    from agentkv.integrations.sglang.hidden_states import reset_rows
    from agentkv.integrations.sglang.runtime import reset_extend_rows

    reset_rows()
    reset_extend_rows()


@dataclass
class Steps:
    """One scheduler process's memory objects, and the scheduler's steps on a request.

    ``ReqToTokenPool``, ``MHATokenToKVPool``, the allocator (``RefCountedTokenAllocator``, a
    ``TokenToKVPoolAllocator``), ``AgentKVRadixCache`` (a ``RadixCache``), SGLang's ``Req``,
    ``alloc_token_slots`` (evicts from the tree when short) and ``release_kv_cache`` are
    SGLang's or subclass SGLang's; what the scheduler does between them (admission, extend
    range, row writes, decode appends) is replayed here as its page-size-1 code does it.
    """

    r2t: object
    kv: object
    alloc: object
    cache: object
    planner: object
    layers: int
    heads: int
    dim: int

    def request(
        self,
        ids: Sequence[int],
        payload: str | None = None,
        tags: str | None = None,
        extra_key: str | None = None,
        rid: str = "r",
    ):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        custom = {}
        if payload is not None:
            custom["agentkv"] = payload
        if tags is not None:
            custom["agentkv_tags"] = tags
        sp = SamplingParams(max_new_tokens=64, custom_params=custom or None)
        return Req(rid, "", array("q", ids), sp, extra_key=extra_key)

    def kv_value(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The K written for token ``ids`` at positions ``pos``: ``[n, H, D]``, a function of
        both, so a read-back tells which token and position a slot holds."""
        base = (ids.float() * 1000 + pos.float()).reshape(-1, 1, 1)
        return base + torch.arange(self.heads * self.dim).reshape(1, self.heads, self.dim) * 0.001

    def prefill(self, req, chunk: int | None = None, plan: bool = True) -> None:
        """Admission, then extend chunk by chunk (``cache_unfinished_req`` between chunks), then
        the agentkv plan once the prompt is complete and SGLang's post-prefill insert
        (``plan=False``: stop before the plan)."""
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        from agentkv.integrations.sglang.request_plan import request_state
        from agentkv.integrations.sglang.runtime import plan_one

        req.init_next_round_input(self.cache)  # SGLang's match_prefix
        self.cache.inc_lock_ref(req.last_node)  # PrefillAdder locks the matched prefix
        n = len(req.origin_input_ids)
        while True:
            pre = len(req.prefix_indices)
            end = n if chunk is None else min(n, pre + chunk)
            req.set_extend_range(pre, end)
            if req.req_pool_idx is None:
                assert self.r2t.alloc([req]) is not None
            locs = alloc_token_slots(self.cache, end - pre)
            row = req.req_pool_idx
            self.r2t.write((row, slice(0, pre)), req.prefix_indices.to(torch.int32))
            self.r2t.write((row, slice(pre, end)), locs.to(torch.int32))
            ids = torch.tensor(req.origin_input_ids[pre:end])
            pos = torch.arange(pre, end)
            for layer in range(self.layers):
                self.kv.get_key_buffer(layer)[locs] = self.kv_value(ids, pos)
                self.kv.get_value_buffer(layer)[locs] = -self.kv_value(ids, pos)
            if req.kv is None:
                req.kv = ReqKvInfo(kv_allocated_len=end, swa_evicted_seqlen=0)
            req.kv.kv_allocated_len = end
            req.kv_committed_len = end
            if end == n:
                break
            self.cache.cache_unfinished_req(req, chunked=True)
        state = request_state(req)
        if not plan:
            return
        if state is not None and state.evicts:
            plan_one(self.planner, self.r2t, self.alloc, req, state)
        elif state is not None:
            state.planned = True
        # SGLang inserts every unfinished request's prompt after its prefill
        # (batch_result_processor: maybe_cache_unfinished_req), after the plan ran
        self.cache.cache_unfinished_req(req)

    def decode(self, req, tokens: Sequence[int]) -> None:
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        for t in tokens:
            loc = alloc_token_slots(self.cache, 1)
            p = req.kv_committed_len
            self.r2t.write((req.req_pool_idx, slice(p, p + 1)), loc.to(torch.int32))
            for layer in range(self.layers):
                self.kv.get_key_buffer(layer)[loc] = self.kv_value(
                    torch.tensor([t]), torch.tensor([p])
                )
            req.output_ids.append(t)
            req.kv_committed_len += 1
            req.kv.kv_allocated_len += 1

    def finish(self, req, insert: bool = True, grouped: bool = True) -> None:
        """Release a finished request as SGLang's decode-result step does: inside a free
        group (``free_group_begin`` .. ``free_group_end``), so frees made while the group is
        open (the tree's too) are applied together at its end."""
        from sglang.srt.mem_cache.common import release_kv_cache

        if grouped:
            self.alloc.free_group_begin()
        release_kv_cache(req, self.cache, is_insert=insert)
        if grouped:
            self.alloc.free_group_end()

    def row(self, req) -> torch.Tensor:
        return self.r2t.req_to_token[req.req_pool_idx, : req.kv_committed_len].to(torch.int64)


def make_steps(
    size: int = 512, rows: int = 16, ctx: int = 512, layers: int = 2, heads: int = 2, dim: int = 8
) -> Steps:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from agentkv.integrations.sglang.radix_cache import AgentKVRadixCache
    from agentkv.integrations.sglang.runtime import Planner
    from agentkv.integrations.sglang.slot_refcounts import RefCountedTokenAllocator
    from agentkv.methods.base import ModelShape

    r2t = ReqToTokenPool(size=rows, max_context_len=ctx, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=size,
        page_size=1,
        dtype=torch.float32,
        head_num=heads,
        head_dim=dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = RefCountedTokenAllocator(size, torch.float32, "cpu", kv, need_sort=False)
    alloc.strict = True  # every allocation checked against the counts
    planner = Planner(ModelShape(layers, heads * 2, heads, dim), 2 * layers * heads * dim * 4)
    cache = AgentKVRadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc, page_size=1
        ),
        methods=planner.methods,
    )
    return Steps(r2t, kv, alloc, cache, planner, layers, heads, dim)


@pytest.fixture
def steps() -> Steps:
    return make_steps()


@pytest.fixture
def steps_factory():
    """:func:`make_steps` with other sizes."""
    return make_steps


class HostReads(TorchDispatchMode):
    """Counts host reads (on any tensor): :func:`device_reads.host_read`'s ops and
    ``Tensor.tolist``."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.ops: list[str] = []
        tolist = torch.Tensor.tolist

        def counted(t):
            self.ops.append("tolist")
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __enter__(self):
        self.ops = []  # counted per block
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        read = host_read(str(func), args)
        if read is not None:
            self.ops.append(read)
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.ops)


@pytest.fixture
def host_reads(monkeypatch) -> HostReads:
    """A :class:`HostReads` counter: ``with host_reads: ...``, then ``host_reads.count``."""
    return HostReads(monkeypatch)
