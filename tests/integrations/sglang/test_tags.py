"""The HTTP-side hook on SGLang's real request types: payload validated (HTTP 400 path), the
prompt tagged with agentkv's tagger on the Qwen3 tokenizer, the tags carried in
``custom_params`` and read back by the scheduler side for the same token ids."""

from __future__ import annotations

from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

from agentkv.integrations.sglang.request_plan import TAGS_KEY, decode_tags, request_state
from agentkv.integrations.sglang.runtime import tag_chat_request
from agentkv.policies import FullCache, IntentKV, parse_policy
from agentkv.wire import KVPayload, PayloadError, build_payload, encode_payload

REPO = Path(__file__).resolve().parents[3]
QWEN_DIRS = [
    REPO.parent / "shared" / "data" / "qwen3-tokenizer",
    Path("/work/shared/data/qwen3-tokenizer"),
]

MESSAGES = [
    {"role": "system", "content": "You are an airline agent. Follow the policy."},
    {"role": "user", "content": "Change my flight to Boston, reservation ABC123."},
    {"role": "assistant", "content": "Let me look that up."},
    {"role": "user", "content": "It is for tomorrow morning please."},
]


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    for d in QWEN_DIRS:
        if d.is_dir():
            return AutoTokenizer.from_pretrained(str(d))
    pytest.skip("Qwen3 tokenizer (shared/data/qwen3-tokenizer) not found")


def chat(qwen, payload: str, ids=None):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput

    request = ChatCompletionRequest(
        model="m", messages=MESSAGES, custom_params={"agentkv": payload}
    )
    if ids is None:
        ids = qwen.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    adapted = GenerateReqInput(
        input_ids=ids, sampling_params={"custom_params": dict(request.custom_params)}
    )
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=qwen))
    return adapted, request, serving


def test_tags_travel_in_custom_params_and_fit_sglangs_tokens(qwen):
    payload = encode_payload(build_payload(MESSAGES, IntentKV(budget=64), "s1"))
    adapted, request, serving = chat(qwen, payload)
    tag_chat_request((adapted, request), serving, request)
    raw = adapted.sampling_params["custom_params"][TAGS_KEY]
    tags = decode_tags(raw, adapted.input_ids)
    assert tags is not None and len(tags) == len(adapted.input_ids)
    act = [i for i, a in enumerate(tags.actionable) if a]
    text = qwen.decode([adapted.input_ids[i] for i in act])
    assert "tomorrow morning" in text and "Boston" not in text  # the latest user message
    assert tags.protected_prefix > 0 and tags.tail_start < len(tags)
    # the scheduler side reads them back from SGLang's Req
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "", array("q", adapted.input_ids), SamplingParams(**adapted.sampling_params))
    state = request_state(req)
    assert state.tagged and state.tags.actionable == tags.actionable
    assert state.payload.session_id == "s1"


def test_fullcache_requests_are_not_rendered_again(qwen):
    """No plan reads a FullCache request's tags: the HTTP hook does not render it a second
    time (a client's forged tags are still dropped)."""
    payload = encode_payload(build_payload(MESSAGES, FullCache(), "s1"))
    adapted, request, serving = chat(qwen, payload)
    adapted.sampling_params["custom_params"][TAGS_KEY] = "forged"
    tag_chat_request((adapted, request), serving, request)
    assert TAGS_KEY not in adapted.sampling_params["custom_params"]


def test_other_tokens_run_untagged(qwen):
    payload = encode_payload(KVPayload(session_id="s", policy=IntentKV(budget=64)))
    adapted, request, serving = chat(qwen, payload, ids=[1, 2, 3, 4])
    forged = '{"n":4,"codes":"AAAAAA==","actionable":[[0,4]],"protected_prefix":0,"tail_start":4}'
    adapted.sampling_params["custom_params"][TAGS_KEY] = forged  # a client's own "tags"
    tag_chat_request((adapted, request), serving, request)
    assert TAGS_KEY not in adapted.sampling_params["custom_params"]
    assert (
        decode_tags(
            '{"n":1,"codes":"/w==","actionable":[],"protected_prefix":0,"tail_start":1}', [1]
        )
        is None
    )
    assert decode_tags("not json", [1]) is None
    assert (
        decode_tags(
            '{"n":1,"codes":"AA==","actionable":[],"protected_prefix":0,"tail_start":1}', [1, 2]
        )
        is None
    )


def test_malformed_payload_is_a_400_naming_the_field(qwen):
    adapted, request, serving = chat(
        qwen, '{"version": 1, "session_id": "s", "policy": {"method": "intentkv", "budget": -3}}'
    )
    with pytest.raises(PayloadError) as e:
        tag_chat_request((adapted, request), serving, request)
    assert isinstance(e.value, ValueError)  # SGLang's handler answers ValueError with HTTP 400
    assert e.value.field == "policy.budget"


def test_policies_sglang_cannot_serve_are_a_400(qwen):
    payload = encode_payload(KVPayload(session_id="s", policy=parse_policy("uniform_quant:bits=4")))
    adapted, request, serving = chat(qwen, payload)
    with pytest.raises(PayloadError) as e:
        tag_chat_request((adapted, request), serving, request)
    assert e.value.field == "policy.method"


def test_a_streamed_agentkv_request_gets_its_usage_chunk_by_default(qwen):
    """As the embedded server: ``include_usage`` unless the request says otherwise."""
    payload = encode_payload(build_payload(MESSAGES, IntentKV(budget=64), "s1"))
    adapted, request, serving = chat(qwen, payload)
    request.stream = True
    tag_chat_request((adapted, request), serving, request)
    assert request.stream_options.include_usage is True
    from sglang.srt.entrypoints.openai.protocol import StreamOptions

    adapted, request, serving = chat(qwen, payload)
    request.stream, request.stream_options = True, StreamOptions(include_usage=False)
    tag_chat_request((adapted, request), serving, request)
    assert request.stream_options.include_usage is False  # the client's choice stays


def test_kvzap_is_served_and_a_missing_surrogate_is_a_400(qwen, model_dir, tmp_path):
    """Method.check runs in the HTTP process on SGLang's ModelConfig, as the embedded engine
    runs it: KVzap without a surrogate for this model (the tiny Qwen3 of conftest), or with a
    folder that holds none, is a 400 naming the field; with one trained for it, it is served."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig

    from agentkv.methods.kvzap_surrogate import Surrogate, SurrogateMeta
    from agentkv.policies import KVzap

    config = ModelConfig(model_path=str(model_dir))
    tokenizer_manager = SimpleNamespace(
        tokenizer=qwen, model_config=config, server_args=SimpleNamespace(tp_size=1)
    )

    def run(policy):
        payload = encode_payload(build_payload(MESSAGES, policy, "s"))
        adapted, request, _ = chat(qwen, payload)
        tag_chat_request((adapted, request), SimpleNamespace(tokenizer_manager=tokenizer_manager),
                         request)  # fmt: skip
        return adapted

    for policy, field in (
        (KVzap(), "policy.surrogate"),
        (KVzap(surrogate_path=str(tmp_path)), "policy.surrogate_path"),
    ):
        with pytest.raises(PayloadError) as e:
            run(policy)
        assert e.value.field == field and "train-kvzap" in str(e.value)
    L, hq, hkv, d, dh = 2, 4, 2, 8, 32  # conftest's QWEN3_CONFIG
    meta = SurrogateMeta("tiny-qwen3", "mlp", L, hq, hkv, d, dh)
    Surrogate(
        meta, torch.zeros(L, dh // 8, dh), torch.zeros(L, dh // 8),
        torch.zeros(L, hkv, dh // 8), torch.zeros(L, hkv),
    ).save(tmp_path / "mlp.safetensors")  # fmt: skip
    adapted = run(KVzap(surrogate_path=str(tmp_path)))
    assert decode_tags(adapted.sampling_params["custom_params"][TAGS_KEY], adapted.input_ids)


TOOL_MESSAGES = [
    {"role": "system", "content": "You are an airline agent. Follow the policy."},
    {"role": "user", "content": "Change my flight, I am sofia_kim_7287."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_user_details",
                    "arguments": '{"user_id":"sofia_kim_7287"}',  # compact, as clients send
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"name": "Sofia Kim"}'},
    {"role": "user", "content": "It is for tomorrow morning please."},
]


def test_tool_call_history_is_tagged_on_sglangs_ids(qwen):
    """SGLang parses assistant tool-call arguments and the template re-serialises them
    (``{"user_id": "..."}``); the tagger must render the same, or the request runs untagged."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import (
        normalize_assistant_tool_call_arguments,
    )
    from sglang.srt.managers.io_struct import GenerateReqInput

    payload = encode_payload(build_payload(TOOL_MESSAGES, IntentKV(budget=64), "s1"))
    request = ChatCompletionRequest(
        model="m", messages=TOOL_MESSAGES, custom_params={"agentkv": payload}
    )
    msgs = [m.model_dump() for m in request.messages]  # SGLang's _apply_jinja_template
    for m in msgs:
        normalize_assistant_tool_call_arguments(m, strict=False)
        if m.get("content") is None:
            m["content"] = ""
    ids = qwen.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    assert '"user_id": "sofia' in qwen.decode(ids)
    adapted = GenerateReqInput(
        input_ids=ids, sampling_params={"custom_params": dict(request.custom_params)}
    )
    serving = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=qwen))
    tag_chat_request((adapted, request), serving, request)
    raw = adapted.sampling_params["custom_params"].get(TAGS_KEY)
    assert raw is not None, "untagged: the tagger's render differs from SGLang's ids"
    tags = decode_tags(raw, ids)
    assert tags is not None and tags.protected_prefix > 0
    act = [i for i, a in enumerate(tags.actionable) if a]
    assert "tomorrow morning" in qwen.decode([ids[i] for i in act])
