"""Chat rendering: messages + tools -> prompt text -> token ids with per-token tags.

Uses the model's own chat template when it renders tools and tool calls; otherwise (e.g.
SmolLM2, whose template drops them and fails on ``content: None``) the bundled ChatML
template with Qwen-style ``<tool_call>`` JSON (templates/chatml_tools.jinja).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from agentkv.annotation import MessageAnnotation, openai_view
from agentkv.tags import Role
from agentkv.token_tagger import (
    IMAGE_PLACEHOLDER,
    Slot,
    TokenTags,
    align_pieces,
    image_sequence,
    marker,
    message_parts,
    message_text_pieces,
    tag_tokens,
)

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ChatRenderer",
    "bundled_template",
    "normalise_message",
    "template_renders_tools",
]

TOOLS_TEMPLATE = "chatml_tools.jinja"


def bundled_template(name: str = TOOLS_TEMPLATE) -> str:
    return resources.files("agentkv.engine").joinpath("templates", name).read_text()


def template_renders_tools(template: str | None) -> bool:
    """True when a chat template handles tools, tool calls and tool results."""
    return (
        bool(template)
        and all(k in template for k in ("tools", "tool_calls"))
        and ("'tool'" in template or '"tool"' in template)
    )


def normalise_message(
    message: Any, marks: Mapping[Slot, str] | None = None, image_text: str = IMAGE_PLACEHOLDER
) -> dict[str, Any]:
    """An OpenAI-format dict a Jinja chat template can render (content always a string).

    Content blocks are joined (images as ``image_text``: :data:`IMAGE_PLACEHOLDER`, or a VLM's
    image tokens); reasoning (blocks, or
    ``<think>...</think>`` inline in an assistant's content) moves to ``reasoning_content``;
    tool-call arguments become JSON strings. ``marks`` replaces the text of the given piece
    slots (see :func:`agentkv.token_tagger.message_text_pieces`), for locating pieces.
    """
    view = openai_view(message)
    reasoning, blocks, calls = message_parts(view, image_text)
    marks = marks or {}
    reasoning = marks.get(("reasoning", 0), reasoning)
    texts = [marks.get(("content", b), text) for b, (text, _) in enumerate(blocks)]
    if not texts and ("content", 0) in marks:
        texts = [marks[("content", 0)]]
    out: dict[str, Any] = {"role": view["role"], "content": "".join(texts)}
    if view.get("name"):
        out["name"] = view["name"]
    if reasoning:
        out["reasoning_content"] = reasoning
    originals = view.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": originals[c].get("id", "") or "",
                "type": "function",
                "function": {
                    "name": marks.get(("name", c), name),
                    "arguments": marks.get(("arguments", c), args),
                },
            }
            for c, (name, args) in enumerate(calls)
        ]
    if view.get("tool_call_id"):
        out["tool_call_id"] = view["tool_call_id"]
    return out


class ChatRenderer:
    """Renders and tags requests for one tokenizer.

    ``image_tokens``: a VLM's tokens per image (Gemma 3: 256). Image content blocks then
    render as the tokenizer's image tokens (:func:`agentkv.token_tagger.image_sequence`),
    tagged with the image modality; None (a text-only model): as :data:`IMAGE_PLACEHOLDER`.
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        image_tokens: int | None = None,
        image_token: str | None = None,
    ):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        if template is None:
            template = own if template_renders_tools(own) else bundled_template()
        self.template = template
        self.image_text = image_sequence(tokenizer, image_tokens, image_token)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            chat_template=self.template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        annotations: Sequence[MessageAnnotation] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenTags:
        """Render, tokenize and tag a request (``messages``: OpenAI dicts or LangChain)."""
        views = [openai_view(m) for m in messages]
        norm = [normalise_message(v, image_text=self.image_text) for v in views]
        text = self.render(norm, tools, add_generation_prompt)
        messages_end = None
        if add_generation_prompt:
            bare = self.render(norm, tools, add_generation_prompt=False)
            messages_end = len(bare) if text.startswith(bare) else None
        return tag_tokens(
            text,
            views,
            self.tokenizer,
            annotations,
            messages_end=messages_end,
            spans=self._locate(views, text, tools, add_generation_prompt),
            system_end=self._system_end(norm, text, tools),
            image_text=self.image_text,
        )

    def _locate(
        self,
        views: Sequence[Mapping[str, Any]],
        text: str,
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[list[list[tuple[int, int]]]] | None:
        """Where each message piece was rendered (``tag_tokens``'s ``spans``), from a second
        rendering with every piece replaced by a marker; None when the template's scaffolding
        depends on the contents (then the tagger searches for the pieces)."""
        pieces = [message_text_pieces(v, Role.USER, self.image_text) for v in views]
        flat = [p.text for ps in pieces for p in ps]
        # first with empty messages marked too (exact anchors for them), then without
        for mark_empty in (True, False):
            if not mark_empty and all(flat):
                break
            marked, k = [], 0
            for v, ps in zip(views, pieces, strict=True):
                marks: dict[Slot, str] = {}
                for p in ps:
                    if p.text or mark_empty:
                        marks[p.slot] = marker(k)
                    k += 1
                marked.append(normalise_message(v, marks, self.image_text))
            try:
                marked_text = self.render(marked, tools, add_generation_prompt)
            except Exception:  # a template that rejects the markers
                return None
            spans = align_pieces(text, marked_text, flat)
            if spans is not None:
                out, k = [], 0
                for ps in pieces:
                    out.append(spans[k : k + len(ps)])
                    k += len(ps)
                return out
        return None

    def _system_end(
        self,
        norm: Sequence[Mapping[str, Any]],
        text: str,
        tools: Sequence[Mapping[str, Any]] | None,
    ) -> int | None:
        """End of the system block: the leading system messages (and tools) rendered alone,
        when that rendering is a prefix of the request's; None otherwise."""
        n = next((i for i, m in enumerate(norm) if m["role"] not in {"system", "developer"}), 0)
        if n == 0:
            return None
        try:
            block = self.render(norm[:n], tools, add_generation_prompt=False)
        except Exception:  # templates that insist on a user message
            return None
        return len(block) if block and text.startswith(block) else None
