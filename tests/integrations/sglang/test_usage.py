"""``usage.agentkv`` on SGLang, along SGLang's own path: the scheduler's real ``Req`` and pools
(the plan applied), SGLang's output-stream accumulator (``BatchTokenIDOutput``), a pickle
round trip (the ZMQ hop), the detokenizer's and the tokenizer manager's real output handlers,
then ``OpenAIServingChat``'s real response builders with the plugin's hooks (wrapped by
SGLang's own ``HookRegistry`` wrapper), serialised by FastAPI's encoder."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentkv.engine.telemetry import KVUsage
from agentkv.integrations.sglang.request_plan import request_state
from agentkv.integrations.sglang.usage import (
    USAGE_KEY,
    add_usage_to_response,
    add_usage_to_stream,
    attach_usage,
    usage_from_meta,
    watch_stream_content,
)
from agentkv.policies import parse_policy
from agentkv.wire import build_payload, encode_payload

QWEN_DIRS = [
    Path(__file__).resolve().parents[3].parent / "shared" / "data" / "qwen3-tokenizer",
    Path("/work/shared/data/qwen3-tokenizer"),
]
MESSAGES = [{"role": "user", "content": "Where is my bag?"}]


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    for d in QWEN_DIRS:
        if d.is_dir():
            return AutoTokenizer.from_pretrained(str(d))
    pytest.skip("Qwen3 tokenizer (shared/data/qwen3-tokenizer) not found")


def tokens(n: int, seed: int) -> list[int]:
    import random

    g = random.Random(seed)
    return [g.randrange(1000, 20000) for _ in range(n)]


def accumulator(force_interval: int):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.output_streamer import (
        _GenerationStreamAccumulator,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return _GenerationStreamAccumulator(
        return_logprob=False,
        return_hidden_states=False,
        return_routed_experts=False,
        return_indexer_topk=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL,
        default_stream_interval=1,
        default_force_stream_interval=force_interval,
        get_cached_tokens_details=lambda req: None,
    )


def detokenizer(qwen):
    """SGLang's DetokenizerManager without its ZMQ sockets (its output handler is real)."""
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager, LimitedCapacityDict

    d = object.__new__(DetokenizerManager)
    d.tokenizer, d.vocab_size = qwen, len(qwen)
    d.decode_status = LimitedCapacityDict(capacity=64)
    d.disable_tokenizer_batch_decode = False
    d.is_tool_call_parser_gpt_oss = False
    return d


class TokenizerSide:
    """SGLang's ``TokenizerManager._handle_batch_output`` on the states of our requests (its
    sockets and event loop left out): it builds each request's ``meta_info`` and output dicts."""

    def __init__(self, server_args):
        from sglang.srt.managers.tokenizer_manager import TokenizerManager

        self.handle = TokenizerManager._handle_batch_output
        self.self = SimpleNamespace(
            rid_to_state={},
            server_args=server_args,
            config_value=lambda key: "default",
            enable_metrics=False,
            incremental_streaming_output=False,
            enable_lora=False,
            dump_requests_folder=None,
            crash_dump_folder=None,
        )
        self.self._remove_req_state = lambda rid: self.self.rid_to_state.pop(rid, None)
        self.states = []

    def add(self, rid: str, stream: bool):
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.managers.tokenizer_manager import ReqState
        from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

        state = ReqState(
            [],
            False,
            asyncio.Event(),
            GenerateReqInput(input_ids=[1], stream=stream),
            APIServerReqTimeStats(),
        )
        self.self.rid_to_state[rid] = state
        state.yielded = []
        self.states.append(state)
        return state

    def receive(self, batch_str) -> None:
        """Handle one batch, then wake each request as ``_wait_one_response`` does: take its
        latest output (a stream's deferred text resolved), into ``state.yielded``."""
        asyncio.run(self.handle(self.self, batch_str))
        for state in self.states:
            if state.out_list:
                out = dict(state.out_list[-1])
                state.out_list = []
                if out.get("text") is None:
                    out["text"] = state.get_text()
                out["output_ids"] = list(out["output_ids"])
                state.yielded.append(out)


@pytest.fixture
def server_args(model_dir):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=str(model_dir), page_size=1, device="cpu", enable_cache_report=True
    )


def serving_chat(qwen, server_args):
    """SGLang's OpenAIServingChat (its real ``__init__``) over a tokenizer-manager stand-in
    holding what the response builders read."""
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from transformers import AutoConfig

    tm = SimpleNamespace(
        server_args=server_args,
        tokenizer=qwen,
        model_config=SimpleNamespace(
            get_default_sampling_params=lambda: {},
            hf_config=AutoConfig.from_pretrained(server_args.model_path),
        ),
    )
    return OpenAIServingChat(tm, SimpleNamespace(force_reasoning=False))


def run_request(steps, qwen, server_args, policy: str, stream: bool, n_out: int = 6):
    """One agentkv request and one stock request through the scheduler's steps, sent in two
    sends (one mid-decode, one at the end) through SGLang's output path. Returns the agentkv
    request, its tokenizer-side state, and the stock one's."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    prompt = tokens(96, 1)
    payload = encode_payload(build_payload(MESSAGES, parse_policy(policy), "sess-u"))
    req = steps.request(prompt, payload, rid="ak")
    stock = steps.request(tokens(40, 2), rid="stock")
    for r in (req, stock):
        r.stream = stream
        state = request_state(r)
        if state is not None:
            attach_usage(r, state, steps.planner)  # what before_extend does
        steps.prefill(r)
    detok, tok = detokenizer(qwen), TokenizerSide(server_args)
    ak_state, stock_state = tok.add("ak", stream), tok.add("stock", stream)
    out = list(range(2000, 2000 + n_out))
    half = n_out // 2
    for phase, chunk in enumerate((out[:half], out[half:])):
        for r in (req, stock):
            steps.decode(r, chunk)
            if phase == 1:
                r.finished_reason = FINISH_LENGTH(length=n_out)
        acc = accumulator(force_interval=half)
        for r in (req, stock):
            acc.accept(req=r)
        wire = pickle.loads(pickle.dumps(acc.to_payload(dp_rank=0, is_idle_batch=False)))
        tok.receive(detok.handle_batch_token_id_out(wire))
    for r in (req, stock):
        steps.finish(r)
    return req, ak_state, stock_state


def test_the_finishing_send_carries_the_requests_kv_usage(steps, qwen, server_args):
    req, ak, stock = run_request(steps, qwen, server_args, "streamingllm:budget=32,sinks=4", False)
    meta = ak.yielded[-1]["meta_info"]
    column = meta[USAGE_KEY]
    assert len(column) == 6 and column[:-1] == [None] * 5  # one entry per output token
    u = KVUsage.model_validate({k: v for k, v in column[-1].items() if k != "dropped_image_parts"})
    plan = request_state(req).usage
    assert u.method == "streamingllm" and u.session_id == "sess-u"
    assert u.prompt_tokens == 96 and u.completion_tokens == 6 == meta["completion_tokens"]
    assert u.evicted_tokens == plan["evicted_tokens"] == 96 - 32
    assert u.planned_live_kv_tokens == 32 and u.live_kv_tokens == 32 + 5  # last token: no KV
    assert u.resident_kv_tokens == 37 and u.live_kv_bytes == 37 * steps.planner.bytes_per_token
    assert u.evicted_entries == 64 * steps.layers * steps.heads
    assert u.compression_ratio == round(1 - 37 / (96 + 5), 4)
    assert u.raw_kv_reads == sum(96 + j + 1 for j in range(5))
    assert u.effective_kv_reads == sum(32 + j + 1 for j in range(5))
    assert u.forced_tokens == 0 and u.plan_note.startswith("untagged")  # no tags: nothing forced
    assert u.prefix_hit_tokens == meta["cached_tokens"] == 0
    assert u.wall_time_s >= u.prefill_time_s >= 0
    # the stock request in the same batches: SGLang pads its column, nothing else
    assert stock.yielded[-1]["meta_info"][USAGE_KEY] == [None] * 6
    assert usage_from_meta(stock.yielded[-1]["meta_info"]) is None


def test_non_streamed_chat_response_has_usage_agentkv(steps, qwen, server_args):
    from fastapi.encoders import jsonable_encoder
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse

    _, ak, stock = run_request(steps, qwen, server_args, "full", False)
    serving = serving_chat(qwen, server_args)
    request = ChatCompletionRequest(model="m", messages=MESSAGES)
    built = serving._build_chat_response(request, [ak.yielded[-1]], 1)
    response = add_usage_to_response(built, serving, request, [ak.yielded[-1]], 1)
    assert isinstance(response, ChatCompletionResponse)
    body = jsonable_encoder(response)  # FastAPI's serialisation of the handler's return value
    usage = body["usage"]
    assert usage["prompt_tokens"] == 96 and usage["completion_tokens"] == 6
    assert usage["agentkv"]["method"] == "full" and usage["agentkv"]["evicted_tokens"] == 0
    assert usage["agentkv"]["live_kv_tokens"] == 96 + 5
    assert body["choices"][0]["message"]["content"] == qwen.decode(list(range(2000, 2006)))
    assert set(body) == set(jsonable_encoder(built))  # SGLang's response, plus usage.agentkv
    # a stock request's response is left as SGLang built it
    plain = serving._build_chat_response(request, [stock.yielded[-1]], 1)
    assert add_usage_to_response(plain, serving, request, [stock.yielded[-1]], 1) is None


def test_streamed_chat_final_usage_chunk_has_usage_agentkv(steps, qwen, server_args):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    class HookedChat(OpenAIServingChat):  # the plugin's hooks, wrapped as HookRegistry wraps
        _generate_stream_content = _wrap_fn(
            OpenAIServingChat._generate_stream_content, watch_stream_content, HookType.AROUND
        )
        _generate_chat_stream = _wrap_fn(
            OpenAIServingChat._generate_chat_stream, add_usage_to_stream, HookType.AROUND
        )

    _, ak, _ = run_request(steps, qwen, server_args, "streamingllm:budget=32,sinks=4", True)
    assert len(ak.yielded) == 2  # the mid-decode send and the finishing one
    serving = serving_chat(qwen, server_args)
    serving.__class__ = HookedChat

    async def generate_request(adapted, raw):
        for out in ak.yielded:
            yield out

    serving.tokenizer_manager.generate_request = generate_request

    def collect(include_usage: bool) -> list[dict]:
        request = ChatCompletionRequest(
            model="m",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": include_usage},
        )

        async def run():
            return [c async for c in serving._generate_chat_stream(None, request, None)]

        chunks = asyncio.run(run())
        assert chunks[-1] == "data: [DONE]\n\n"
        return [json.loads(c[len("data: ") :]) for c in chunks[:-1]]

    chunks = collect(include_usage=True)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    ak_usage = final["usage"]["agentkv"]
    assert ak_usage["evicted_tokens"] == 64 and ak_usage["live_kv_tokens"] == 37
    assert all("agentkv" not in (c.get("usage") or {}) for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == qwen.decode(list(range(2000, 2006)))
    # without include_usage there is no usage chunk (SGLang's and OpenAI's convention)
    assert all(c.get("usage") is None for c in collect(include_usage=False))
