"""Token tagger: per-message annotations + the rendered chat template -> per-token tags.

Driven by the rendered text and the tokenizer's special tokens, never by a model list:

1. Each message's own text pieces (reasoning, content, tool-call names and arguments, tool
   results, image placeholders; :func:`message_text_pieces`) are located in the rendered
   prompt. The renderer locates them exactly: it renders the request a second time with every
   piece replaced by a unique marker, which yields the template's scaffolding verbatim, and
   :func:`align_pieces` matches that scaffolding against the real rendering (a piece may lose
   surrounding whitespace to the template). When that fails (scaffolding that depends on the
   contents) or no renderer is involved, the pieces are searched for in order. A piece's
   characters take the piece's semantic role (``reasoning``, ``tool_call``, the message's body
   role) and modality.
2. Every other character is scaffolding. Scaffolding of the system block (system prompt, tool
   schemas, default system text a template adds) is ``inst``, except special tokens, markup
   added tokens (``<tool_call>``) and role markers (``system`` after ``<|im_start|>``), which
   are ``delim``; elsewhere it is ``delim`` and belongs to the message whose share it falls in:
   a message's share runs from its opening special token (``<|im_start|>`` and role marker)
   to its own closing one (``<|im_end|>``), so the closing token takes its message's turn
   bucket and actionable flag. A message with no text (an empty tool result) still owns its
   own markers.
3. Temporal bucket = age of the owning message's turn relative to the newest turn.

The protected prefix is the system block (the leading system messages and tools as the
template renders them alone, when the renderer can tell); the actionable span is every token
owned by an actionable message; the tail is the scaffolding after the last message (the
generation prompt). Pure Python (no torch): the engine converts lists to tensors.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from agentkv.annotation import MessageAnnotation, annotate_messages, current_turn
from agentkv.tags import Modality, Role, TagCode, Temporal

IMAGE_PLACEHOLDER = "<image>"

_IMAGE_BLOCKS = {"image_url", "image", "input_image"}
_REASONING_BLOCKS = {"reasoning", "thinking"}
#: a role name right after a special token (``<|im_start|>system\n``): a role marker.
_ROLE_MARKER = re.compile(r"[ \t]*(?:system|developer|user|assistant|tool|function|ipython)\b\n?")
#: added tokens not flagged special that are markup (``<think>``, ``<tool_call>``).
_MARKUP_TOKEN = re.compile(r"[<\[]\S*[>\]]")


class OffsetTokenizer(Protocol):
    """What the tagger needs of a (fast, HF-style) tokenizer."""

    all_special_tokens: list[str]

    def __call__(self, text: str, **kwargs: Any) -> Mapping[str, Any]: ...


@dataclass
class TokenTags:
    """Per-token tags of one rendered request (all lists have one entry per token)."""

    token_ids: list[int]
    codes: list[int]  # TagCode per token
    # owning message; -1 for template text of no message: the tail (generation prompt) and
    # the system block a template adds when the request has no system message
    message_index: list[int]
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
            self.actionable[i]
            or i >= self.tail_start
            or (protect_prefix and i < self.protected_prefix)
            for i in range(n)
        ]

    def role_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for c in self.codes:
            name = TagCode.role_of(c).name.lower()
            counts[name] = counts.get(name, 0) + 1
        return counts


#: where a piece comes from in its message: ``("reasoning", 0)``, ``("content", block)``,
#: ``("name", call)``, ``("arguments", call)``.
Slot = tuple[str, int]


class Piece(NamedTuple):
    """One text piece of a message, as a template renders it verbatim."""

    text: str
    role: Role
    modality: Modality
    slot: Slot


@dataclass
class _Region:
    start: int
    end: int
    role: Role
    modality: Modality
    message: int


# ------------------------------------------------------------------ message pieces


def split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """``"<think>\\nR\\n</think>\\n\\nC"`` -> ``("R", "C")``: the split Qwen-style templates
    apply to assistant content that carries its reasoning inline; ``(None, content)`` when
    there is no ``</think>``."""
    if "</think>" not in content:
        return None, content
    parts = content.split("</think>")
    reasoning = parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, parts[-1].lstrip("\n")


def _block_reasoning(block: Mapping[str, Any]) -> str:
    text = block.get("reasoning") or block.get("thinking") or block.get("text")
    if text is None and isinstance(block.get("summary"), list):  # OpenAI Responses API
        text = "\n".join(str(s.get("text", "")) for s in block["summary"] if isinstance(s, Mapping))
    return str(text or "")


def message_parts(
    message: Mapping[str, Any], image_text: str = IMAGE_PLACEHOLDER
) -> tuple[str | None, list[tuple[str, Modality]], list[tuple[str, str]]]:
    """What a chat template renders of an OpenAI-view message, in rendering order:
    ``(reasoning, content blocks [(text, modality)], tool calls [(name, arguments JSON)])``.

    Reasoning: ``reasoning_content``, else the reasoning blocks of the content (joined by
    newlines), else ``<think>...</think>`` inline in an assistant's string content. Image
    blocks render as ``image_text``: :data:`IMAGE_PLACEHOLDER` for a text-only model, a VLM's
    image tokens (:func:`image_sequence`) for a VLM.
    """
    reasoning = message.get("reasoning_content") or None
    content = message.get("content")
    blocks: list[tuple[str, Modality]] = []
    block_reasoning: list[str] = []
    if isinstance(content, str):
        if reasoning is None and message.get("role") == "assistant":
            reasoning, content = split_inline_reasoning(content)
        blocks.append((content, Modality.TEXT))
    elif isinstance(content, (list, tuple)):
        for block in content:
            if isinstance(block, str):
                blocks.append((block, Modality.TEXT))
                continue
            kind = block.get("type", "text")
            if kind in _IMAGE_BLOCKS:
                blocks.append((image_text, Modality.IMAGE))
            elif kind in _REASONING_BLOCKS:
                block_reasoning.append(_block_reasoning(block))
            else:
                blocks.append((str(block.get("text", "") or ""), Modality.TEXT))
    if reasoning is None and block_reasoning:
        reasoning = "\n".join(block_reasoning)
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {"name": call.get("name"), "arguments": call.get("args", {})}
        args = fn.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args)
        calls.append((str(fn.get("name") or ""), args))
    return (None if reasoning is None else str(reasoning)), blocks, calls


def message_text_pieces(
    message: Mapping[str, Any], body: Role, image_text: str = IMAGE_PLACEHOLDER
) -> list[Piece]:
    """The pieces of an OpenAI-view message, in rendering order (:func:`message_parts`): the
    non-empty ones, or, for a message with no text at all, its empty content slot."""
    reasoning, blocks, calls = message_parts(message, image_text)
    pieces = []
    if reasoning:
        pieces.append(Piece(reasoning, Role.REASONING, Modality.TEXT, ("reasoning", 0)))
    pieces += [
        Piece(text, body, modality, ("content", b))
        for b, (text, modality) in enumerate(blocks)
        if text
    ]
    for c, (name, args) in enumerate(calls):
        if name:
            pieces.append(Piece(name, Role.TOOL_CALL, Modality.TEXT, ("name", c)))
        if args:
            pieces.append(Piece(args, Role.TOOL_CALL, Modality.TEXT, ("arguments", c)))
    return pieces or [Piece("", body, Modality.TEXT, ("content", 0))]


def image_sequence(
    tokenizer: Any, tokens_per_image: int | None, image_token: str | None = None
) -> str:
    """What one image occupies in a VLM's prompt, from the tokenizer's own image tokens.

    The tokenizer's image token (``image_token``, e.g. Gemma 3's ``<image_soft_token>``)
    repeated ``tokens_per_image`` times (the model's image sequence length: 256 for Gemma 3),
    between its begin- and end-of-image tokens when it declares them (``boi_token`` /
    ``eoi_token``: ``<start_of_image>`` ... ``<end_of_image>``), as a VLM's processor expands
    the template's image placeholder. :data:`IMAGE_PLACEHOLDER` when ``tokens_per_image`` is
    None or the tokenizer has no image token (a text-only model).
    """
    token = image_token or getattr(tokenizer, "image_token", None)
    if not tokens_per_image or not token:
        return IMAGE_PLACEHOLDER
    if tokens_per_image < 0:
        raise ValueError(f"tokens_per_image must be positive, got {tokens_per_image}")
    boi = getattr(tokenizer, "boi_token", None) or ""
    eoi = getattr(tokenizer, "eoi_token", None) or ""
    return f"{boi}{token * tokens_per_image}{eoi}"


# ------------------------------------------------------------- locating the pieces

MARKER_OPEN, MARKER_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{MARKER_OPEN}(\\d+){MARKER_CLOSE}")


def marker(k: int) -> str:
    """Placeholder of piece ``k`` in a marked rendering (private-use characters)."""
    return f"{MARKER_OPEN}{k}{MARKER_CLOSE}"


def _variants(piece: str) -> list[str]:
    """The piece as a template may print it: verbatim, or with surrounding whitespace stripped."""
    out: list[str] = []
    for v in (
        piece,
        piece.strip("\n"),
        piece.lstrip("\n"),
        piece.rstrip("\n"),
        piece.strip(),
        piece.lstrip(),
        piece.rstrip(),
    ):
        if v not in out:
            out.append(v)
    return out


def align_pieces(
    text: str, marked: str, pieces: Sequence[str]
) -> list[list[tuple[int, int]]] | None:
    """Character spans of each piece in ``text``.

    ``marked`` is the same request rendered with piece ``k`` replaced by :func:`marker` ``(k)``:
    the text between markers is the template's scaffolding and must appear verbatim in
    ``text``; a piece may appear with surrounding whitespace stripped (zero-width spans for
    empty pieces). Returns one list of spans per piece (empty: the template did not render
    it), or None when ``text`` does not follow ``marked`` (scaffolding that depends on the
    contents)."""
    spans: list[list[tuple[int, int]]] = [[] for _ in pieces]
    found = list(_MARKER.finditer(marked))
    pos = prev = 0
    for j, m in enumerate(found):
        k = int(m.group(1))
        if k >= len(pieces):
            return None
        seg = marked[prev : m.start()]
        if not text.startswith(seg, pos):
            return None
        pos += len(seg)
        last = j + 1 == len(found)
        nxt = marked[m.end() : len(marked) if last else found[j + 1].start()]
        for v in _variants(pieces[k]):
            end = pos + len(v)
            if text.startswith(v, pos) and (
                text[end:] == nxt if last else text.startswith(nxt, end)
            ):
                break
        else:
            return None
        spans[k].append((pos, end))
        pos, prev = end, m.end()
    if text[pos:] != marked[prev:]:
        return None
    return spans


def _find(text: str, piece: str, cursor: int) -> tuple[int, int] | None:
    """Locate ``piece`` in ``text`` at or after ``cursor`` (whole, then stripped)."""
    for candidate in (piece, piece.strip()):
        if candidate:
            i = text.find(candidate, cursor)
            if i >= 0:
                return i, i + len(candidate)
    return None


# --------------------------------------------------------------------- the tagger


def tag_tokens(
    text: str,
    messages: Sequence[Mapping[str, Any]],
    tokenizer: OffsetTokenizer,
    annotations: Sequence[MessageAnnotation] | None = None,
    messages_end: int | None = None,
    spans: Sequence[Sequence[Sequence[tuple[int, int]]]] | None = None,
    system_end: int | None = None,
    image_text: str = IMAGE_PLACEHOLDER,
) -> TokenTags:
    """Tag every token of ``text`` (the rendered chat template of ``messages``).

    Args:
        text: the rendered prompt.
        messages: OpenAI-view dicts in request order.
        tokenizer: a fast tokenizer with offsets.
        annotations: default :func:`annotate_messages` of ``messages`` (pass the client's, from
            the wire payload, to honour its view of turns and actionable messages).
        messages_end: the character where the rendering of the messages alone ends (``len`` of
            the template rendered without the generation prompt); what follows is the tail.
            None: no tail.
        spans: ``spans[i][k]``, the character spans where piece ``k`` of
            :func:`message_text_pieces` ``(messages[i])`` was rendered (:func:`align_pieces`);
            None: search for the pieces in order.
        system_end: the character where the system block ends (the leading system messages
            and the tools rendered alone); None: inferred from the special tokens.
        image_text: what each image block was rendered as (:func:`image_sequence`); its
            tokens are tagged with the image modality and the message's role.
    """
    if annotations is None:
        annotations = annotate_messages(messages)
    if len(annotations) != len(messages):
        raise ValueError(
            f"annotations ({len(annotations)}) and messages ({len(messages)}) differ in length"
        )
    if spans is not None and len(spans) != len(messages):
        raise ValueError(f"spans ({len(spans)}) and messages ({len(messages)}) differ in length")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    tail_char = len(text) if messages_end is None else messages_end

    # 1. each message's pieces
    regions: list[_Region] = []
    anchors: list[int | None] = []
    ends: list[int | None] = []
    cursor = 0
    for i, (msg, ann) in enumerate(zip(messages, annotations, strict=True)):
        pieces = message_text_pieces(msg, ann.semantic, image_text)
        hits: list[tuple[int, int, Piece]] = []
        if spans is not None:
            if len(spans[i]) != len(pieces):
                raise ValueError(f"message {i}: {len(spans[i])} spans for {len(pieces)} pieces")
            hits = [(s, e, p) for p, ps in zip(pieces, spans[i], strict=True) for s, e in ps]
        else:
            for p in pieces:
                hit = _find(text, p.text, cursor) if p.text.strip() else None
                if hit is not None and hit[1] <= tail_char:
                    hits.append((hit[0], hit[1], p))
                    cursor = hit[1]
        regions += [_Region(s, e, p.role, p.modality, i) for s, e, p in hits if e > s]
        anchors.append(min((s for s, _, _ in hits), default=None))
        ends.append(max((e for _, e, _ in hits), default=None))
    regions.sort(key=lambda r: r.start)
    region_starts = [r.start for r in regions]

    def region_at(pos: int) -> _Region | None:
        k = bisect.bisect_right(region_starts, pos) - 1
        return regions[k] if k >= 0 and regions[k].start <= pos < regions[k].end else None

    strong, markup = _special_strings(tokenizer)
    strong_spans = [sp for sp in _special_spans(text, strong) if region_at(sp[0]) is None]
    delim_spans = sorted(
        set(strong_spans)
        | set(_special_spans(text, markup))
        | set(_role_markers(text, strong_spans))
    )
    delim_starts = [s for s, _ in delim_spans]

    # 2. the system block and each message's share of the scaffolding
    first_non_system = next(
        (i for i, m in enumerate(messages) if m.get("role") not in {"system", "developer"}), None
    )
    boundary_starts = [s for s, _ in strong_spans]
    if first_non_system is None:
        sys_end_char: int | None = tail_char if system_end is None else system_end
    elif first_non_system > 0:
        sys_end_char = system_end  # None: where message first_non_system's share starts
    else:
        # no system message: any default system text or tool block the template adds ends at
        # the last special token before the first message's text.
        first = anchors[0] if anchors[0] is not None else tail_char
        opening = [s for s in boundary_starts if s < first]
        sys_end_char = opening[-1] if opening else 0
    boundaries = _boundaries(
        anchors, ends, boundary_starts, tail_char, first_non_system, sys_end_char
    )
    if sys_end_char is None:
        assert first_non_system is not None
        sys_end_char = boundaries[first_non_system]

    newest = current_turn(annotations)
    codes, owners, actionable = [], [], []
    packed: dict[tuple[Role, Modality, int], int] = {}
    protected_prefix, tail_start = 0, len(ids)
    for t, (s, e) in enumerate(offsets):
        mid = s if e <= s else (s + e - 1) // 2
        region = region_at(mid)
        if s >= tail_char and region is None:
            owner = -1
            tail_start = min(tail_start, t)
        elif region is not None:
            owner = region.message
        else:  # -1 before the first message: a system block the template added
            owner = bisect.bisect_right(boundaries, s) - 1
        if region is not None:
            role, modality = region.role, region.modality
        elif _in_spans(delim_starts, delim_spans, mid):
            role, modality = Role.DELIM, Modality.TEXT
        elif s < sys_end_char:
            role, modality = Role.INST, Modality.TEXT
        else:
            role, modality = Role.DELIM, Modality.TEXT
        if s < sys_end_char:
            protected_prefix = t + 1
        # text of no message is as old as where it stands: the added system block as the
        # conversation's start, the generation prompt current
        turn = annotations[max(owner, 0)].turn if owner >= 0 or s < sys_end_char else newest
        key = (role, modality, newest - turn)
        code = packed.get(key)
        if code is None:
            code = packed[key] = TagCode.pack(role, modality, Temporal.from_age(newest - turn))
        codes.append(code)
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


def _boundaries(
    anchors: list[int | None],
    ends: list[int | None],
    specials: list[int],
    tail_char: int,
    first_non_system: int | None,
    sys_end_char: int | None,
) -> list[int]:
    """Start character of each message's share of the text.

    Each message's share ends at its own closing token: the first special token after a
    message's last piece closes it (``<|im_end|>``, ``<|eot_id|>``) when another special token
    follows in the gap, so message ``i`` (``i > 0``) starts at the next special token, its
    own opening (``<|im_start|>``); a gap with a single special token gives it to the next
    message. The first non-system message starts after the system block (whose closing token
    is the system block's). Message 0 starts at 0, or after the system block a template adds
    when there is no system message. Messages that could not be located (no text) share the
    special tokens of their gap evenly with the next located message (or the generation
    prompt), when they divide evenly.
    """
    n = len(anchors)
    bounds = [0] * n
    prev_end = 0
    prev_closes = False  # the gap opens with the closing token of the message before it
    i = 0
    while i < n:
        j = i
        while j < n and anchors[j] is None:
            j += 1
        at_system_end = first_non_system is not None and i <= first_non_system <= j
        if at_system_end and sys_end_char and sys_end_char > prev_end:
            prev_end, prev_closes = sys_end_char, False
        gap_end = anchors[j] if j < n else tail_char
        gap = [s for s in specials if prev_end <= s < gap_end]
        if j == n:
            gap += [s for s in specials if s == tail_char]
        members = list(range(i, min(j + 1, n)))
        groups = len(members) + (j == n)
        if len(members) > 1 and gap and len(gap) % groups == 0:
            step = len(gap) // groups
            off = int(prev_closes and step >= 2)
            starts = [gap[m * step + off] for m in range(len(members))]
        else:
            off = int(prev_closes and len(gap) >= 2)
            starts = [gap[off] if gap else prev_end] * len(members)
        for idx, start in zip(members, starts, strict=True):
            if idx == first_non_system and sys_end_char:
                start = max(start, sys_end_char)
            elif idx == 0:
                start = 0
            bounds[idx] = start if idx == 0 else max(start, bounds[idx - 1])
        if j < n:
            prev_end = max(prev_end, ends[j] if ends[j] is not None else gap_end)
            prev_closes = True
        i = j + 1
    return bounds


def _special_strings(tokenizer: Any) -> tuple[list[str], list[str]]:
    """(special tokens, markup added tokens not flagged special).

    Special tokens (``<|im_start|>``) delimit messages; markup added tokens (Qwen's ``<think>``,
    ``<tool_call>``, ``<tool_response>``) are ``delim`` where they are scaffolding but do not
    delimit messages."""
    strong = {s for s in getattr(tokenizer, "all_special_tokens", None) or [] if s}
    markup = set()
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        content = str(getattr(tok, "content", tok))
        if not content:
            continue
        if getattr(tok, "special", False):
            strong.add(content)
        elif _MARKUP_TOKEN.fullmatch(content):
            markup.add(content)
    return sorted(strong), sorted(markup - strong)


def _special_spans(text: str, specials: Sequence[str]) -> list[tuple[int, int]]:
    spans = []
    for tok in specials:
        i = text.find(tok)
        while i >= 0:
            spans.append((i, i + len(tok)))
            i = text.find(tok, i + len(tok))
    return sorted(spans)


def _role_markers(text: str, specials: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Role names right after a special token (``<|im_start|>assistant\\n``)."""
    out = []
    for _, e in specials:
        m = _ROLE_MARKER.match(text, e)
        if m and m.end() > e:
            out.append((e, m.end()))
    return out


def _in_spans(starts: list[int], spans: list[tuple[int, int]], pos: int) -> bool:
    k = bisect.bisect_right(starts, pos) - 1
    return k >= 0 and spans[k][0] <= pos < spans[k][1]
