"""Message annotation: what the client knows about each chat message.

Works on OpenAI-format message dicts and on LangChain message objects (duck-typed, so this
module imports neither LangChain nor torch). One :class:`MessageAnnotation` per message, in
request order.

Turns: a turn runs from one user message up to the next; messages before the first user
message (the system prompt) belong to turn 0, as does the first user message.

Actionable query: the latest user or tool message that decides the next step. When the
conversation ends with several tool results in a row (parallel tool calls), all of them
are actionable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentkv.tags import Modality, ModalityName, Role, RoleName

ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]

# LangChain message `.type` -> OpenAI role.
_LANGCHAIN_TYPES: dict[str, ChatRole] = {
    "system": "system",
    "developer": "developer",
    "human": "user",
    "ai": "assistant",
    "AIMessageChunk": "assistant",
    "HumanMessageChunk": "user",
    "SystemMessageChunk": "system",
    "ToolMessageChunk": "tool",
    "FunctionMessageChunk": "function",
    "tool": "tool",
    "function": "function",
}
_SEMANTIC_OF_ROLE: dict[str, Role] = {
    "system": Role.INST,
    "developer": Role.INST,
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "tool": Role.OBS,
    "function": Role.OBS,
}
_IMAGE_BLOCKS = {"image_url", "image", "input_image"}
_REASONING_BLOCKS = {"reasoning", "thinking"}
_TOOL_CALL_BLOCKS = {"tool_call", "tool_use", "function_call"}


class MessagePart(BaseModel):
    """One part of a message body, in rendering order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    semantic: RoleName
    modality: ModalityName = Modality.TEXT
    chars: int = Field(0, ge=0, description="characters of text in the part (0 for images)")


class MessageAnnotation(BaseModel):
    """Client-side annotation of one request message."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0, description="position of the message in the request")
    role: ChatRole
    turn: int = Field(ge=0, description="turn index; a turn starts at each user message")
    semantic: RoleName = Field(description="semantic role of the message body")
    parts: list[MessagePart] = Field(default_factory=list)
    actionable: bool = Field(False, description="part of the actionable query span")
    name: str | None = Field(None, description="tool name for tool results")
    node: str | None = Field(None, description="graph node that sent the request")

    @property
    def modalities(self) -> set[Modality]:
        return {p.modality for p in self.parts}

    @property
    def has_reasoning(self) -> bool:
        return any(p.semantic is Role.REASONING for p in self.parts)

    @property
    def num_tool_calls(self) -> int:
        return sum(p.semantic is Role.TOOL_CALL for p in self.parts)


def _text_len(value: Any) -> int:
    return len(value) if isinstance(value, str) else 0


def _args_len(args: Any) -> int:
    """Characters of tool-call arguments: a JSON string as is, a dict as LangChain sends it."""
    if args is None:
        return 0
    if isinstance(args, str):
        return len(args)
    # langchain_core's convert_to_openai_messages uses json.dumps(args, ensure_ascii=False).
    return len(json.dumps(args, ensure_ascii=False, default=str))


def _reasoning_len(block: Mapping[str, Any]) -> int:
    text = block.get("reasoning") or block.get("thinking") or block.get("text")
    if text is None and isinstance(block.get("summary"), list):  # OpenAI Responses API
        return sum(_text_len(s.get("text")) for s in block["summary"] if isinstance(s, Mapping))
    return _text_len(text)


def _content_parts(
    content: Any, body: Role, skip_call_ids: frozenset[str] = frozenset()
) -> list[MessagePart]:
    """Parts of a message's ``content`` (a string or a list of content blocks).

    Tool-call blocks whose id is in ``skip_call_ids`` are left out: they duplicate an entry of
    the message's ``tool_calls`` (Anthropic ``tool_use`` blocks, LangChain v1 content).
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [MessagePart(semantic=body, chars=len(content))] if content else []
    if not isinstance(content, (list, tuple)):
        raise TypeError(
            f"content must be a string or a list of content blocks, got {type(content).__name__}"
        )
    parts: list[MessagePart] = []
    for block in content:
        if isinstance(block, str):
            parts.append(MessagePart(semantic=body, chars=len(block)))
            continue
        if not isinstance(block, Mapping):
            raise TypeError(f"content block must be a dict or str, got {type(block).__name__}")
        kind = block.get("type", "text")
        if kind in _IMAGE_BLOCKS:
            parts.append(MessagePart(semantic=body, modality=Modality.IMAGE))
        elif kind in _REASONING_BLOCKS:
            parts.append(MessagePart(semantic=Role.REASONING, chars=_reasoning_len(block)))
        elif kind in _TOOL_CALL_BLOCKS:
            if block.get("id") is not None and block.get("id") in skip_call_ids:
                continue
            args = next((block[k] for k in ("args", "input", "arguments") if k in block), None)
            chars = _text_len(block.get("name")) + _args_len(args)
            parts.append(MessagePart(semantic=Role.TOOL_CALL, chars=chars))
        else:
            parts.append(MessagePart(semantic=body, chars=_text_len(block.get("text"))))
    return parts


def _tool_call_parts(tool_calls: Iterable[Any] | None) -> list[MessagePart]:
    parts = []
    for call in tool_calls or ():
        call = dict(call)
        fn = call.get("function") or {}
        name = fn.get("name") or call.get("name") or ""
        args = fn.get("arguments") if fn else call.get("args")
        parts.append(MessagePart(semantic=Role.TOOL_CALL, chars=len(name) + _args_len(args)))
    return parts


def _tool_call_ids(tool_calls: Iterable[Any] | None) -> frozenset[str]:
    return frozenset(
        c.get("id") for c in tool_calls or () if isinstance(c, Mapping) and c.get("id") is not None
    )


def openai_view(message: Any) -> dict[str, Any]:
    """An OpenAI-style dict view of an OpenAI dict or a LangChain message."""
    if isinstance(message, Mapping):
        if "role" not in message:
            raise ValueError(f"message has no 'role': {dict(message)!r:.200}")
        return dict(message)
    msg_type = getattr(message, "type", None)
    if msg_type not in _LANGCHAIN_TYPES:
        raise TypeError(
            f"cannot annotate {type(message).__name__}: expected an OpenAI message dict or a "
            "LangChain message (System/Human/AI/Tool)"
        )
    extra = getattr(message, "additional_kwargs", {}) or {}
    out: dict[str, Any] = {
        "role": _LANGCHAIN_TYPES[msg_type],
        "content": message.content,
        "name": getattr(message, "name", None),
    }
    if out["role"] == "assistant":
        out["tool_calls"] = list(getattr(message, "tool_calls", None) or [])
        if extra.get("reasoning_content"):
            out["reasoning_content"] = extra["reasoning_content"]
    return out


def _actionable_indices(roles: Sequence[str]) -> set[int]:
    """Indices of the actionable query span (see module docstring)."""
    last = next(
        (i for i in range(len(roles) - 1, -1, -1) if roles[i] in {"user", "tool", "function"}), None
    )
    if last is None:
        return set()
    span = {last}
    if roles[last] in {"tool", "function"}:
        i = last - 1
        while i >= 0 and roles[i] in {"tool", "function"}:
            span.add(i)
            i -= 1
    return span


def annotate_messages(messages: Sequence[Any], node: str | None = None) -> list[MessageAnnotation]:
    """Annotate OpenAI-format message dicts or LangChain messages, one per message.

    Raises ``ValueError`` / ``TypeError`` naming the offending message for malformed input.
    """
    views = []
    for i, m in enumerate(messages):
        try:
            views.append(openai_view(m))
        except (TypeError, ValueError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"message {i}: {e}"
            ) from None
    roles = [v["role"] for v in views]
    for i, r in enumerate(roles):
        if not isinstance(r, str) or r not in _SEMANTIC_OF_ROLE:
            raise ValueError(
                f"message {i}: unknown role {r!r}; expected one of {sorted(_SEMANTIC_OF_ROLE)}"
            )
    actionable = _actionable_indices(roles)
    out: list[MessageAnnotation] = []
    turn, seen_user = 0, False
    for i, v in enumerate(views):
        role = v["role"]
        if role == "user":
            turn += 1 if seen_user else 0
            seen_user = True
        body = _SEMANTIC_OF_ROLE[role]
        parts: list[MessagePart] = []
        if role == "assistant" and v.get("reasoning_content"):
            parts.append(
                MessagePart(semantic=Role.REASONING, chars=_text_len(v["reasoning_content"]))
            )
        try:
            calls = v.get("tool_calls") if role == "assistant" else None
            parts += _content_parts(v.get("content"), body, _tool_call_ids(calls))
            parts += _tool_call_parts(calls)
        except (TypeError, ValueError) as e:
            raise (TypeError if isinstance(e, TypeError) else ValueError)(
                f"message {i}: {e}"
            ) from None
        out.append(
            MessageAnnotation(
                index=i,
                role=role,
                turn=turn,
                semantic=body,
                parts=parts,
                actionable=i in actionable,
                name=v.get("name") if role in {"tool", "function"} else None,
                node=node,
            )
        )
    return out


def actionable_span(annotations: Sequence[MessageAnnotation]) -> list[int]:
    """Message indices of the actionable query, in order."""
    return [a.index for a in annotations if a.actionable]


def current_turn(annotations: Sequence[MessageAnnotation]) -> int:
    return max((a.turn for a in annotations), default=0)
