"""``parse_tool_calls`` and the chat template's rendering of tools, calls and results."""

from __future__ import annotations

import json

import pytest

from agentkv.engine.chat_template import bundled_template, template_renders_tools
from agentkv.engine.tool_calls import parse_tool_calls

from .chats import WEATHER_TOOL, weather_call


def one_call(text: str) -> tuple[str | None, dict]:
    content, calls = parse_tool_calls(text)
    assert len(calls) == 1, calls
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    return content, call["function"]


def test_plain_text_is_unchanged():
    for text in ["", "hello", "  spaced  \n", "a <tool_call without close", "</tool_call>"]:
        assert parse_tool_calls(text) == (text, [])


def test_single_call():
    content, fn = one_call('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content is None
    assert fn["name"] == "f" and json.loads(fn["arguments"]) == {"x": 1}


def test_text_around_calls_and_multiple_calls():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"q": "x y"}}</tool_call>\n  Done. '
    )
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{}, {"q": "x y"}]
    assert content == "Let me check.\nDone."
    assert len({c["id"] for c in calls}) == 2


def test_leading_text_keeps_its_leading_whitespace():
    content, _ = one_call(' Sure: <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == " Sure:"


def test_arguments_variants():
    # a JSON string stays as sent; "parameters" is accepted for "arguments"; none -> {}
    _, fn = one_call('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert fn["arguments"] == '{"a": 2}'
    _, fn = one_call('<tool_call>{"name": "f", "parameters": {"a": 3}}</tool_call>')
    assert json.loads(fn["arguments"]) == {"a": 3}
    _, fn = one_call('<tool_call>{"name": "f"}</tool_call>')
    assert fn["arguments"] == "{}"
    _, fn = one_call('<tool_call>{"name": "f", "arguments": {"s": "</tool_call> é {}"}}')
    assert json.loads(fn["arguments"]) == {"s": "</tool_call> é {}"}


@pytest.mark.parametrize("tail", ["", "\n", "\n</tool_call", "</", "<"])
def test_unterminated_block_at_the_end_is_parsed(tail):
    content, fn = one_call('ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}' + tail)
    assert content == "ok" and json.loads(fn["arguments"]) == {"a": [1, 2]}


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        "<tool_call></tool_call>",
        '<tool_call>{"name": "f", </tool_call>',
        '<tool_call>{"name": "f"} junk</tool_call>',
        '<tool_call>{"name": "f"}</tool_cal>',
    ],
)
def test_invalid_blocks_stay_in_content(block):
    text = f"before {block} after"
    assert parse_tool_calls(text) == (text, [])
    # next to a valid call, the invalid block is content
    content, calls = parse_tool_calls(block + '<tool_call>{"name": "g"}</tool_call>')
    assert [c["function"]["name"] for c in calls] == ["g"] and content == block


def test_template_choice(engine):
    own = engine.tokenizer.chat_template
    assert not template_renders_tools(own)  # SmolLM2's template drops tools
    assert template_renders_tools(bundled_template())
    assert engine.renderer.template == bundled_template()


def test_template_renders_tools_calls_and_results(engine):
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "Weather in Rome?"},
        weather_call(1, "Rome"),
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "warm"},
        {"role": "assistant", "content": "Sunny and warm."},
        {"role": "user", "content": "Thanks"},
    ]
    text = engine.renderer.render(messages, [WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nSYS\n\n# Tools")
    assert json.dumps(WEATHER_TOOL["function"]["name"]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in (
        text
    )
    # consecutive tool results share one user turn
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")
    # tool-call tokens are tagged as tool calls, the results as observations
    tags = engine.renderer.encode(messages, [WEATHER_TOOL])
    counts = tags.role_counts()
    assert counts.get("tool_call", 0) > 0 and counts.get("obs", 0) > 0
    assert tags.protected_prefix > len(engine.tokenizer("SYS # Tools")["input_ids"])
    # no tools: no tool block
    assert "# Tools" not in engine.renderer.render(messages[:2])


ECHOED = 'Sunny in Paris. <tool_response>\n{"temp": 20}\n</tool_response> and more'


def test_echoed_template_markup_is_cut_from_content():
    assert parse_tool_calls(ECHOED) == ("Sunny in Paris.", [])
    content, calls = parse_tool_calls(weather_call_text() + "\n<tool_response>\nfake")
    assert content is None and len(calls) == 1
    assert parse_tool_calls("</tool_response>")[0] == ""


def weather_call_text() -> str:
    return '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_streamed_deltas_never_show_echoed_markup():
    from agentkv.engine.engine import _ContentStream

    deltas: list[str] = []
    stream = _ContentStream(deltas.append, stop=[])
    for end in range(1, len(ECHOED) + 1):  # the decoded text as it grows
        stream.update(ECHOED[:end])
        assert "<tool_r" not in "".join(deltas)
    content, _ = parse_tool_calls(ECHOED)
    stream.finish(content)
    assert "".join(deltas) == content == "Sunny in Paris."
