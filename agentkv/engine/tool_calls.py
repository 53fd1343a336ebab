"""Parsing Qwen-style ``<tool_call>{json}</tool_call>`` blocks out of generated text."""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()
#: Template markup of turns the model must not write (a tool result it never received):
#: the output ends where the first one starts.
FOREIGN_TURN_MARKERS = ("<tool_response>", "</tool_response>")


def cut_foreign_turn(text: str) -> str:
    """``text`` up to the first of :data:`FOREIGN_TURN_MARKERS` (trailing whitespace
    dropped), or unchanged when it has none. A small model imitates the template and
    echoes ``<tool_response>...`` after its answer; that is never content."""
    cut = min((i for m in FOREIGN_TURN_MARKERS if (i := text.find(m)) >= 0), default=-1)
    return text if cut < 0 else text[:cut].rstrip()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _block_at(text: str, start: int) -> tuple[dict[str, Any], int] | None:
    """The call object of the block opening at ``start`` and the end of the block, or None.

    A block is ``<tool_call>``, one JSON object (parsed as JSON, so ``</tool_call>`` inside a
    string does not end it), then ``</tool_call>``, or the end of the text, possibly inside the
    closing tag (generation cut off after the object)."""
    try:
        obj, end = _DECODER.raw_decode(text, _skip_ws(text, start + len(OPEN)))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    end = _skip_ws(text, end)
    if text.startswith(CLOSE, end):
        return obj, end + len(CLOSE)
    # the text ends after the object, or inside the closing tag (generation cut off)
    return (obj, len(text)) if CLOSE.startswith(text[end:]) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` in OpenAI format.

    The text is first cut at template markup the model must not write
    (:func:`cut_foreign_turn`). Blocks that are not a JSON object with a string ``name``
    stay in the content. With at least one call, the content is the text around the calls:
    the part before the first call (trailing whitespace dropped) and the stripped non-empty
    parts after calls, joined by newlines; None when nothing is left. Without calls the
    (cut) text is returned unchanged.
    """
    text = cut_foreign_turn(text)
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        block = _block_at(text, start)
        if block is None:
            pos = start + len(OPEN)
            continue
        obj, end = block
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
        kept.append(text[last:start])
        last = pos = end
    if not calls:
        return text, []
    kept.append(text[last:])
    parts = [kept[0].rstrip()] + [k.strip() for k in kept[1:]]
    content = "\n".join(p for p in parts if p)
    return content or None, calls
