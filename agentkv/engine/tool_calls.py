"""Parsing Qwen-style ``<tool_call>{json}</tool_call>`` blocks out of generated text."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` in OpenAI format; blocks that are not valid JSON with a
    ``name`` stay in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    content = "".join(kept).strip()
    return content or None, calls
