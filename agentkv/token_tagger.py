"""Token tagger: per-message annotations + the rendered chat template -> per-token tags.

Driven by the rendered text and the tokenizer's special tokens, never by a model list:

1. Each message's own text pieces (reasoning, content, tool-call names and arguments, tool
   results, image placeholders) are located in the rendered prompt in order; a piece's
   characters take the piece's semantic role (``reasoning``, ``tool_call``, the message's
   body role) and modality.
2. Every other character is scaffolding. Scaffolding before the first non-system message
   (the system block: system prompt, tool schemas, default system text a template adds)
   is ``inst``, except special tokens, which are ``delim``; elsewhere it is ``delim``
   and belongs to the message that follows it (its role markers).
3. Temporal bucket = age of the owning message's turn relative to the newest turn.

The protected prefix is the system block; the actionable span is every token owned by an
actionable message; the tail is the scaffolding after the last message (the generation
prompt). Pure Python (no torch): the engine converts lists to tensors.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentkv.annotation import MessageAnnotation, annotate_messages, current_turn
from agentkv.tags import Modality, Role, TagCode, Temporal

IMAGE_PLACEHOLDER = "<image>"


class OffsetTokenizer(Protocol):
    """What the tagger needs of a (fast, HF-style) tokenizer."""

    all_special_tokens: list[str]

    def __call__(self, text: str, **kwargs: Any) -> Mapping[str, Any]: ...


@dataclass
class TokenTags:
    """Per-token tags of one rendered request (all lists have one entry per token)."""

    token_ids: list[int]
    codes: list[int]  # TagCode per token
    message_index: list[int]  # owning message, -1 for the tail (generation prompt)
    protected_prefix: int  # tokens [0, protected_prefix) are the system block
    actionable: list[bool]  # token belongs to the actionable query
    tail_start: int  # first token after the last message
    text: str = field(repr=False, default="")

    def __len__(self) -> int:
        return len(self.token_ids)

    def forced(self, protect_prefix: bool = True) -> list[bool]:
        """Forced-keep set: actionable query + tail (+ protected prefix)."""
        n = len(self.token_ids)
        return [
            self.actionable[i] or i >= self.tail_start or (protect_prefix and i < self.protected_prefix)
            for i in range(n)
        ]

    def role_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.codes:
            name = TagCode.role_of(c).name.lower()
            counts[name] = counts.get(name, 0) + 1
        return counts


@dataclass
class _Region:
    start: int
    end: int
    role: Role
    modality: Modality
    message: int


def message_text_pieces(message: Mapping[str, Any], body: Role) -> list[tuple[str, Role, Modality]]:
    """The pieces of a normalised (OpenAI-dict) message that a template renders verbatim."""
    pieces: list[tuple[str, Role, Modality]] = []
    if message.get("reasoning_content"):
        pieces.append((str(message["reasoning_content"]), Role.REASONING, Modality.TEXT))
    content = message.get("content")
    if isinstance(content, str):
        pieces.append((content, body, Modality.TEXT))
    elif isinstance(content, list):
        for block in content:
            kind = block.get("type", "text") if isinstance(block, Mapping) else "text"
            if kind in {"image_url", "image", "input_image"}:
                pieces.append((IMAGE_PLACEHOLDER, body, Modality.IMAGE))
            elif kind in {"reasoning", "thinking"}:
                text = block.get("reasoning") or block.get("thinking") or block.get("text") or ""
                pieces.append((str(text), Role.REASONING, Modality.TEXT))
            else:
                text = block if isinstance(block, str) else block.get("text", "")
                pieces.append((str(text), body, Modality.TEXT))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or call
        pieces.append((str(fn.get("name", "")), Role.TOOL_CALL, Modality.TEXT))
        args = fn.get("arguments", fn.get("args"))
        if args is not None:
            args = args if isinstance(args, str) else json.dumps(args)
            pieces.append((args, Role.TOOL_CALL, Modality.TEXT))
    return [p for p in pieces if p[0].strip()]


def _find(text: str, piece: str, cursor: int) -> tuple[int, int] | None:
    """Locate ``piece`` in ``text`` at or after ``cursor`` (whole, then stripped)."""
    for candidate in (piece, piece.strip()):
        if candidate:
            i = text.find(candidate, cursor)
            if i >= 0:
                return i, i + len(candidate)
    return None


def tag_tokens(
    text: str,
    messages: Sequence[Mapping[str, Any]],
    tokenizer: OffsetTokenizer,
    annotations: Sequence[MessageAnnotation] | None = None,
    messages_end: int | None = None,
) -> TokenTags:
    """Tag every token of ``text`` (the rendered chat template of ``messages``).

    ``messages`` are normalised OpenAI dicts in request order; ``annotations`` default to
    :func:`annotate_messages` of them (pass the client's, from the wire payload, to honour
    its view of turns and actionable messages). ``messages_end`` is the character where the
    rendering of the messages alone ends (``len`` of the template rendered without the
    generation prompt); what follows is the tail. None: no tail.
    """
    if annotations is None:
        annotations = annotate_messages(messages)
    if len(annotations) != len(messages):
        raise ValueError(
            f"annotations ({len(annotations)}) and messages ({len(messages)}) differ in length"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]

    specials = sorted({s for s in tokenizer.all_special_tokens if s} | _added_special(tokenizer))
    special_spans = _special_spans(text, specials)

    # 1. locate each message's pieces in order
    regions: list[_Region] = []
    first_anchor: list[int] = []
    cursor = 0
    for i, (msg, ann) in enumerate(zip(messages, annotations, strict=True)):
        start = None
        for piece, role, modality in message_text_pieces(msg, ann.semantic):
            hit = _find(text, piece, cursor)
            if hit is None:
                continue
            regions.append(_Region(hit[0], hit[1], role, modality, i))
            start = hit[0] if start is None else start
            cursor = hit[1]
        first_anchor.append(cursor if start is None else start)
    last_end = cursor

    # 2. message boundaries: scaffolding before a message's first anchor belongs to it,
    #    starting at the first special token after the previous message's last piece.
    boundaries: list[int] = []
    prev_end = 0
    for i in range(len(messages)):
        anchor = first_anchor[i]
        between = [s for s, _ in special_spans if prev_end <= s < anchor]
        boundaries.append(between[0] if between and i > 0 else (0 if i == 0 else prev_end))
        prev_end = max(prev_end, _region_end(regions, i, anchor))
    first_non_system = next(
        (i for i, m in enumerate(messages) if m.get("role") not in {"system", "developer"}), None
    )
    sys_end_char = boundaries[first_non_system] if first_non_system is not None else last_end
    if first_non_system is not None and first_non_system == 0:
        # no system message: any default system text the template adds ends at the
        # last special token opening the first message.
        opening = [s for s, _ in special_spans if s < first_anchor[0]]
        sys_end_char = opening[-1] if opening else 0
    tail_char = len(text) if messages_end is None else messages_end

    region_starts = [r.start for r in regions]
    special_starts = [s for s, _ in special_spans]
    special_set = {(s, e) for s, e in special_spans}
    newest = current_turn(annotations)

    codes, owners, actionable = [], [], []
    protected_prefix, tail_start = 0, len(ids)
    for t, (s, e) in enumerate(offsets):
        mid = s if e <= s else (s + e - 1) // 2
        k = bisect.bisect_right(region_starts, mid) - 1
        region = regions[k] if k >= 0 and regions[k].start <= mid < regions[k].end else None
        if s >= tail_char and region is None:
            owner = -1
            tail_start = min(tail_start, t)
        elif region is not None:
            owner = region.message
        else:
            owner = max(bisect.bisect_right(boundaries, s) - 1, 0)
        if region is not None:
            role, modality = region.role, region.modality
        elif (s, e) in special_set or _in_special(special_starts, special_spans, s):
            role, modality = Role.DELIM, Modality.TEXT
        elif s < sys_end_char:
            role, modality = Role.INST, Modality.TEXT
        else:
            role, modality = Role.DELIM, Modality.TEXT
        if s < sys_end_char:
            protected_prefix = t + 1
        turn = annotations[owner].turn if owner >= 0 else newest
        codes.append(TagCode.pack(role, modality, Temporal.from_age(newest - turn)))
        owners.append(owner)
        actionable.append(owner >= 0 and annotations[owner].actionable)
    return TokenTags(
        token_ids=ids,
        codes=codes,
        message_index=owners,
        protected_prefix=protected_prefix,
        actionable=actionable,
        tail_start=tail_start,
        text=text,
    )


def _region_end(regions: list[_Region], message: int, default: int) -> int:
    ends = [r.end for r in regions if r.message == message]
    return max(ends) if ends else default


def _added_special(tokenizer: Any) -> set[str]:
    """Added tokens flagged special (e.g. Qwen's <tool_call>, <think> when special)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(tok) for tok in decoder.values() if getattr(tok, "special", False)}


def _special_spans(text: str, specials: Sequence[str]) -> list[tuple[int, int]]:
    spans = []
    for tok in specials:
        i = text.find(tok)
        while i >= 0:
            spans.append((i, i + len(tok)))
            i = text.find(tok, i + len(tok))
    return sorted(spans)


def _in_special(starts: list[int], spans: list[tuple[int, int]], pos: int) -> bool:
    k = bisect.bisect_right(starts, pos) - 1
    return k >= 0 and spans[k][0] <= pos < spans[k][1]
