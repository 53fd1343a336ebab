"""Chat rendering: messages + tools -> prompt text -> token ids with per-token tags.

Uses the model's own chat template when it renders tools and tool calls; otherwise (e.g.
SmolLM2, whose template drops them and fails on ``content: None``) the bundled ChatML
template with Qwen-style ``<tool_call>`` JSON (templates/chatml_tools.jinja).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from agentkv.annotation import MessageAnnotation, openai_view
from agentkv.token_tagger import IMAGE_PLACEHOLDER, TokenTags, tag_tokens

TOOLS_TEMPLATE = "chatml_tools.jinja"


def bundled_template(name: str = TOOLS_TEMPLATE) -> str:
    return resources.files("agentkv.engine").joinpath("templates", name).read_text()


def template_renders_tools(template: str | None) -> bool:
    """True when a chat template handles tools, tool calls and tool results."""
    return bool(template) and all(k in template for k in ("tools", "tool_calls")) and (
        "'tool'" in template or '"tool"' in template
    )


def normalise_message(message: Any) -> dict[str, Any]:
    """An OpenAI-format dict a Jinja chat template can render (content always a string)."""
    view = openai_view(message)
    content = view.get("content")
    if isinstance(content, list):
        texts = []
        for block in content:
            if isinstance(block, str):
                texts.append(block)
            elif block.get("type") in {"image_url", "image", "input_image"}:
                texts.append(IMAGE_PLACEHOLDER)
            elif block.get("type") in {"reasoning", "thinking"}:
                view["reasoning_content"] = block.get("reasoning") or block.get("thinking") or ""
            else:
                texts.append(str(block.get("text", "")))
        content = "".join(texts)
    out: dict[str, Any] = {"role": view["role"], "content": content or ""}
    if view.get("name"):
        out["name"] = view["name"]
    if view.get("reasoning_content"):
        out["reasoning_content"] = view["reasoning_content"]
    calls = []
    for call in view.get("tool_calls") or []:
        fn = call.get("function") or {"name": call.get("name"), "arguments": call.get("args", {})}
        args = fn.get("arguments", {})
        calls.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {
                    "name": fn.get("name", ""),
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if calls:
        out["tool_calls"] = calls
    if view.get("tool_call_id"):
        out["tool_call_id"] = view["tool_call_id"]
    return out


class ChatRenderer:
    """Renders and tags requests for one tokenizer."""

    def __init__(self, tokenizer: Any, template: str | None = None):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        if template is None:
            template = own if template_renders_tools(own) else bundled_template()
        self.template = template

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
        norm = [normalise_message(m) for m in messages]
        text = self.render(norm, tools, add_generation_prompt)
        messages_end = None
        if add_generation_prompt:
            bare = self.render(norm, tools, add_generation_prompt=False)
            messages_end = len(bare) if text.startswith(bare) else None
        return tag_tokens(text, norm, self.tokenizer, annotations, messages_end=messages_end)
