"""Engine-level contracts: request validation (RequestError naming the field), the streaming
callback (deltas add up to the final content), default max_tokens near the context end."""

from __future__ import annotations

import pytest

from agentkv.engine.engine import (
    DEFAULT_MAX_TOKENS,
    GenerationConfig,
    RequestError,
    _ContentStream,
)
from agentkv.policies import ARKV, FullCache, KVzap
from agentkv.wire import KVPayload, build_payload

from .chats import tool_call_fewshot

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("messages", "payload", "field"),
    [
        ([], None, "messages"),
        ([{"content": "no role"}], None, "messages"),
        ([{"role": "robot", "content": "x"}], None, "messages"),
        ([{"role": "user", "content": 5}], None, "messages"),
        ([object()], None, "messages"),
        (MSGS, KVPayload(session_id="s", policy=ARKV()), "payload.policy.method"),
        (
            MSGS,
            KVPayload(session_id="s", policy=KVzap(surrogate_path="/nonexistent")),
            "payload.policy.surrogate_path",
        ),
        (MSGS, build_payload(MSGS * 2, FullCache(), "s"), "payload.messages"),
        ([{"role": "user", "content": "hello " * 9000}], None, "messages"),
    ],
    ids=[
        "empty",
        "no-role",
        "bad-role",
        "bad-content",
        "not-a-message",
        "arkv",
        "kvzap-path",
        "count",
        "long",
    ],
)
def test_bad_requests_raise_request_error(engine, messages, payload, field):
    with pytest.raises(RequestError) as info:
        engine.prepare_chat(messages, payload=payload)
    assert info.value.field == field
    assert engine.store.stats().num_requests == 0


@pytest.mark.slow
def test_default_max_tokens_fits_the_context(engine):
    assert engine.prepare_chat(MSGS, gen=GenerationConfig(max_tokens=None)).gen.max_tokens == (
        DEFAULT_MAX_TOKENS
    )
    long = [{"role": "user", "content": "hello " * 8170}]
    prepared = engine.prepare_chat(long, gen=GenerationConfig(max_tokens=None))
    room = engine.max_context - len(prepared.tags)
    assert 0 < room < DEFAULT_MAX_TOKENS
    assert prepared.gen.max_tokens == room
    with pytest.raises(RequestError) as info:  # asked explicitly: the caller's number
        engine.prepare_chat(long, gen=GenerationConfig(max_tokens=room + 1))
    assert info.value.field == "max_tokens"


@pytest.mark.slow
def test_on_text_deltas_add_up_to_content(engine, sid):
    payload = KVPayload(session_id=sid)
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    plain = engine.chat(messages, payload=payload, gen=GenerationConfig(max_tokens=12))
    stop = plain.text[4:7]
    for gen in (GenerationConfig(max_tokens=12), GenerationConfig(max_tokens=12, stop=[stop])):
        deltas: list[str] = []
        res = engine.chat(messages, payload=payload, gen=gen, on_text=deltas.append)
        assert "".join(deltas) == res.content
        assert all(deltas)
        if gen.stop:
            assert res.content == plain.text[: plain.text.index(stop)]
            assert res.finish_reason == "stop"
            assert len(res.token_ids) < len(plain.token_ids)


@pytest.mark.slow
def test_on_text_never_streams_a_tool_call(engine, sid):
    deltas: list[str] = []
    res = engine.chat(
        tool_call_fewshot("Lima"),
        tools=None,
        payload=KVPayload(session_id=sid),
        gen=GenerationConfig(max_tokens=30),
        on_text=deltas.append,
    )
    assert res.tool_calls and res.finish_reason == "tool_calls"
    assert res.content is None and deltas == []
    assert "<tool_call>" in res.text


def run_stream(pieces: list[str], stop: list[str], content: str | None) -> str:
    out: list[str] = []
    stream = _ContentStream(out.append, stop)
    text = ""
    for p in pieces:
        text += p
        stream.update(text)
    stream.finish(content)
    return "".join(out)


@pytest.mark.parametrize(
    ("pieces", "stop", "content"),
    [
        (["Hel", "lo", " wor", "ld"], [], "Hello world"),
        (["Hi ", "<tool", "_call>", '{"name": "f"}'], [], "Hi"),
        (["a", "<", "b"], [], "a<b"),  # a held '<' that is not a tool call comes out
        (["one, ", "tw", "o, three"], ["two"], "one, "),
        (["x", "\ufffd"], [], "x\u00e9"),  # an incomplete character waits
        (["  ", "lead"], [], "  lead"),
    ],
)
def test_content_stream_holds_back_undecided_text(pieces, stop, content):
    assert run_stream(pieces, stop, content) == content


@pytest.mark.slow
def test_greedy_reference_check_agrees_with_greedy_decoding(engine, sid):
    """``score(greedy_reference=...)`` gives what step-by-step greedy decoding gives (the
    reference itself when decoding reproduces it, else up to the first differing token),
    for a policy that keeps the context (FullCache) and one that evicts most of it."""
    from agentkv.policies import StreamingLLM

    messages = [
        {"role": "system", "content": "You are a terse assistant for an airline."},
        {"role": "user", "content": "My booking code is ZX81QP. Please repeat it, then say hi."},
    ]
    target = {"role": "assistant", "content": "Your booking code is ZX81QP. Hi!"}
    n = 8
    reference = engine.score(
        messages, target, None, build_payload(messages, FullCache(), f"{sid}-r"), greedy_tokens=n
    )
    ref = reference.greedy_ids
    assert ref
    # its own check: the argmax after each prefix of its continuation reproduces it
    assert reference.greedy_check[: len(ref)] == ref
    for k, policy in enumerate([FullCache(), StreamingLLM(budget=8, sinks=2)]):
        payload = build_payload(messages, policy, f"{sid}-{k}")
        decoded = engine.score(messages, target, None, payload, greedy_tokens=n).greedy_ids
        payload = build_payload(messages, policy, f"{sid}-{k}b")
        result = engine.score(
            messages, target, None, payload, greedy_tokens=n, greedy_reference=ref
        )
        checked = result.greedy_ids
        assert (checked == ref) == (decoded == ref)
        assert (result.greedy_check == reference.greedy_check) == (k == 0)
        assert checked == decoded[: len(checked)]
        if k == 0:
            assert checked == ref
        else:  # 8 live tokens cannot hold the code: the continuation differs
            assert checked != ref and len(checked) <= len(ref) + 1


@pytest.mark.slow
def test_a_loaded_model_of_another_shape_is_served_with_its_tokenizer(engine, hf_model, sid):
    """``Engine(model, tokenizer=)`` takes a causal LM already built (here: random weights
    at a shape of its own, from a config; how the engine benchmark runs a model's shape with
    nothing downloaded): switched to the agentkv attention, its shape read from its config,
    it decodes greedily what plain transformers (SDPA, no cache) would, and quantizes."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from agentkv.engine.engine import Engine
    from agentkv.methods.base import ModelShape
    from agentkv.policies import UniformQuant

    cfg = copy.deepcopy(hf_model.config)
    cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 128, 256
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 4, 2, 32
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    plain = copy.deepcopy(lm)
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(lm)
    with pytest.raises(ValueError, match="convert it first"):
        Engine(lm, tokenizer=engine.tokenizer, dtype=torch.bfloat16)
    eng = Engine(lm, tokenizer=engine.tokenizer, kv_slots=1024, chunk_size=64)
    assert eng.model.config._attn_implementation == "agentkv"
    assert eng.shape == ModelShape(2, 4, 2, 32)
    msgs = [{"role": "user", "content": "Count the colors of the sea at dusk."}]
    gen = GenerationConfig(max_tokens=12, ignore_eos=True)
    res = eng.chat(msgs, payload=build_payload(msgs, FullCache(), sid), gen=gen)
    ids = eng.renderer.encode(msgs).token_ids  # the prompt the engine decoded from
    with torch.no_grad():
        for tok in res.token_ids:  # greedy, one step at a time, the whole sequence each time
            logits = plain(torch.tensor([ids])).logits[0, -1]
            assert int(torch.argmax(logits)) == tok
            ids = [*ids, tok]
    q = eng.chat(
        msgs, payload=build_payload(msgs, UniformQuant(bits=4, residual=8), sid + "q"), gen=gen
    )
    assert len(q.token_ids) == 12 and q.usage.resident_kv_bytes_by_precision["int4"] > 0
