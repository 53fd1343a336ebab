"""Short conversations for the engine tests (OpenAI format)."""

from __future__ import annotations

import copy
from typing import Any


def tau_messages(system_chars: int, upto: int = 2) -> tuple[list[dict[str, Any]], list[dict]]:
    """The first ``upto`` messages of tau-bench airline trajectory 0 (system prompt cut to
    ``system_chars`` characters) and its tool schemas."""
    from agentkv.bench.traces import load_tau_bench

    trace = load_tau_bench(limit=1)[0]
    msgs = copy.deepcopy(trace.messages[:upto])
    assert msgs[0]["role"] == "system"
    msgs[0]["content"] = msgs[0]["content"][:system_chars]
    return msgs, copy.deepcopy(trace.tools or [])


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def weather_call(i: int, city: str) -> dict[str, Any]:
    """An assistant message that calls ``get_weather`` (OpenAI format)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'},
            }
        ],
    }


def tool_call_fewshot(city: str = "Paris") -> list[dict[str, Any]]:
    """Two worked tool calls then a new question: greedy SmolLM2 answers with a
    ``<tool_call>`` block for ``city`` (checked by the tests that use it)."""
    return [
        {"role": "user", "content": "Weather in Rome?"},
        weather_call(1, "Rome"),
        {"role": "user", "content": "Weather in Oslo?"},
        weather_call(2, "Oslo"),
        {"role": "user", "content": f"Weather in {city}?"},
    ]
