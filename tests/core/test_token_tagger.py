"""Token tagger on real tokenizers and real multi-turn traces.

Two tokenizers: SmolLM2's (the engine's default model) with the bundled ChatML-tools template,
and Qwen3's with its own template (``<think>``, ``<tool_call>``, ``<tool_response>`` are single
added tokens there, and the template only renders the reasoning of assistant turns after the
latest user query).

The reference is an independent re-statement of each template (:func:`render_reference`) that
also records, per rendered character range, which message and which part of it produced the
text. It must reproduce the tokenizer's own rendering exactly; then every token gets its
expected tags from the range it falls in:

- tokens inside a message part: the part's role (``user``, ``assistant``, ``reasoning``,
  ``tool_call``, ``obs``, ``inst`` for system text) and modality, owned by that message;
- scaffolding inside the system block: ``inst`` (tool schemas, template instructions), except
  added/special tokens and the role marker, which are ``delim``;
- other scaffolding: ``delim``;
- temporal bucket: age of the message's turn relative to the newest turn (tail: current).
"""

from __future__ import annotations

import bisect
import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentkv.annotation import annotate_messages
from agentkv.tags import Modality, Role, TagCode, Temporal
from agentkv.token_tagger import IMAGE_PLACEHOLDER, TokenTags
from agentkv.wire import build_payload, decode_payload, encode_payload

pytest.importorskip("transformers")

QWEN_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "qwen3-tokenizer"
BODY = {"system": Role.INST, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.OBS}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    from agentkv.engine.model_loader import resolve_model_dir

    try:
        return AutoTokenizer.from_pretrained(resolve_model_dir(None))
    except Exception as e:  # pragma: no cover - depends on the local install
        pytest.skip(f"default model not available: {e}")


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    if not (QWEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"Qwen3 tokenizer not found at {QWEN_DIR}")
    return AutoTokenizer.from_pretrained(QWEN_DIR)


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def kind_tok(request, smol, qwen):
    return request.param, (smol if request.param == "smollm2" else qwen)


@pytest.fixture(scope="module")
def tau():
    from agentkv.bench.traces import DEFAULT_TAU_BENCH, load_tau_bench, sample

    if not DEFAULT_TAU_BENCH.is_file():
        pytest.skip(f"tau-bench data not found at {DEFAULT_TAU_BENCH}")
    return sample(load_tau_bench(), limit=10, seed=3)


def renderer_for(kind: str, tok):
    from agentkv.engine.chat_template import ChatRenderer, bundled_template

    r = ChatRenderer(tok)
    # SmolLM2's own template drops tools: the renderer must pick the bundled one; Qwen3's own.
    assert (r.template == bundled_template()) == (kind == "smollm2")
    return r


# ----------------------------------------------------------------- reference rendering


@dataclass
class Part:
    start: int
    end: int
    message: int  # -1: scaffolding
    role: Role
    modality: Modality = Modality.TEXT
    marker: bool = False  # role marker text (scaffolding that names a role)


@dataclass
class Reference:
    text: str
    parts: list[Part]
    system_end: int  # end of the system block (0: none)
    messages_end: int  # start of the generation prompt
    closers: dict[int, int]  # start char of each message's closing <|im_end|> -> the message


def _content_blocks(content) -> list[tuple[str, Modality]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, Modality.TEXT)]
    out = []
    for b in content:
        if b.get("type") in {"image_url", "image"}:
            out.append((IMAGE_PLACEHOLDER, Modality.IMAGE))
        else:
            out.append((b["text"], Modality.TEXT))
    return out


def render_reference(messages, tools, kind: str, add_generation_prompt: bool = True) -> Reference:
    """Both templates written out by hand, recording where each message part lands."""
    out: list[str] = []
    parts: list[Part] = []
    closers: dict[int, int] = {}
    pos = 0

    def emit(s: str, message: int = -1, role: Role = Role.DELIM, modality=Modality.TEXT):
        nonlocal pos
        if message >= 0 and s:
            parts.append(Part(pos, pos + len(s), message, role, modality))
        out.append(s)
        pos += len(s)

    def marker(special: str, name: str):
        nonlocal pos
        emit(special)
        parts.append(Part(pos, pos + len(name), -1, Role.DELIM, marker=True))
        emit(name)

    def emit_content(i: int, content, role: Role, lstrip: bool = False):
        blocks = _content_blocks(content)
        if lstrip and blocks:
            blocks[0] = (blocks[0][0].lstrip("\n"), blocks[0][1])
        for text, modality in blocks:
            emit(text, i, role, modality)

    def close(i: int):
        closers[pos] = i
        emit("<|im_end|>\n")

    def text_of(content) -> str:
        return "".join(t for t, _ in _content_blocks(content))

    has_system = messages[0]["role"] == "system"
    if tools:
        marker("<|im_start|>", "system\n")
        if has_system:
            emit(messages[0]["content"], 0, Role.INST)
            emit("\n\n")
        emit(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        for tool in tools:
            emit("\n" + json.dumps(tool, ensure_ascii=False))
        emit(
            "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        )
    elif has_system:
        marker("<|im_start|>", "system\n")
        emit(messages[0]["content"], 0, Role.INST)
        emit("<|im_end|>\n")
    system_end = pos

    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        c = text_of(m.get("content"))
        if m["role"] == "user" and not (
            c.startswith("<tool_response>") and c.endswith("</tool_response>")
        ):
            last_query = i
            break

    n = len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "system" and i == 0:
            continue
        if role == "assistant":
            marker("<|im_start|>", "assistant\n")
            content = text_of(m.get("content"))
            reasoning = m.get("reasoning_content") or ""
            if kind == "smollm2":
                if reasoning:
                    emit("<think>\n")
                    emit(reasoning, i, Role.REASONING)
                    emit("\n</think>\n\n")
                emit_content(i, m.get("content"), Role.ASSISTANT)
            else:
                if i > last_query and (i == n - 1 or reasoning):
                    emit("<think>\n")
                    emit(reasoning.strip("\n"), i, Role.REASONING)
                    emit("\n</think>\n\n")
                    emit_content(i, m.get("content"), Role.ASSISTANT, lstrip=True)
                else:
                    emit_content(i, m.get("content"), Role.ASSISTANT)
            for j, call in enumerate(m.get("tool_calls") or []):
                if (j == 0 and content) or j > 0:
                    emit("\n")
                emit('<tool_call>\n{"name": "')
                emit(call["function"]["name"], i, Role.TOOL_CALL)
                emit('", "arguments": ')
                emit(call["function"]["arguments"], i, Role.TOOL_CALL)
                emit("}\n</tool_call>")
            close(i)
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                marker("<|im_start|>", "user\n")
                emit("<tool_response>\n")
            else:
                emit("\n<tool_response>\n")
            emit_content(i, m.get("content"), Role.OBS)
            emit("\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                close(i)
        else:
            marker("<|im_start|>", role + "\n")
            emit_content(i, m.get("content"), BODY[role])
            close(i)
    messages_end = pos
    if add_generation_prompt:
        marker("<|im_start|>", "assistant\n")
    return Reference("".join(out), parts, system_end, messages_end, closers)


# ------------------------------------------------------------------------ expectations


def expected_turns(roles: list[str]) -> list[int]:
    out, users = [], 0
    for r in roles:
        users += r == "user"
        out.append(max(users - 1, 0))
    return out


def expected_actionable(roles: list[str]) -> set[int]:
    last = max((i for i, r in enumerate(roles) if r in {"user", "tool"}), default=None)
    if last is None:
        return set()
    span = {last}
    while roles[last] == "tool" and last > 0 and roles[last - 1] == "tool":
        last -= 1
        span.add(last)
    return span


def special_ids(tok) -> set[int]:
    ids = set(tok.all_special_ids)
    ids |= {int(i) for i in tok.added_tokens_decoder}
    return ids


@functools.cache
def unpacked(code: int):
    return TagCode.unpack(code)


def encode(kind, tok, messages, tools=None, annotations=None, gen=True) -> TokenTags:
    return renderer_for(kind, tok).encode(messages, tools, annotations, add_generation_prompt=gen)


def check_against_reference(kind, tok, messages, tools=None, gen=True) -> tuple[TokenTags, dict]:
    """Assert every tag of ``encode(messages)`` against the reference; returns stats."""
    from agentkv.engine.chat_template import normalise_message

    tags = encode(kind, tok, messages, tools, gen=gen)
    norm = [normalise_message(m) for m in messages]
    ref = render_reference(messages, tools, kind, gen)
    assert tags.text == ref.text, "reference rendering differs from the template's"
    enc = tok(ref.text, add_special_tokens=False, return_offsets_mapping=True)
    assert tags.token_ids == list(enc["input_ids"])
    offsets = [tuple(o) for o in enc["offset_mapping"]]
    specials = special_ids(tok)
    roles = [m["role"] for m in norm]
    turns = expected_turns(roles)
    newest = max(turns)
    actionable = expected_actionable(roles)

    def bucket(i: int) -> Temporal:
        return Temporal.from_age(newest - turns[i])

    content_tokens = {i: 0 for i in range(len(messages))}
    stats = {"content": 0, "straddle": 0, "scaffold": 0}

    def where(t: int) -> str:
        return f"token {t} {tok.decode([tags.token_ids[t]])!r} at {offsets[t]}"

    parts = sorted(ref.parts, key=lambda p: p.start)
    starts = [p.start for p in parts]
    for t, (s, e) in enumerate(offsets):
        got = unpacked(tags.codes[t])
        near = parts[max(bisect.bisect_right(starts, s) - 2, 0) : bisect.bisect_left(starts, e)]
        inside = [p for p in near if p.start <= s and e <= p.end and e > s]
        overlap = [p for p in near if p.message >= 0 and s < p.end and e > p.start]
        content = [p for p in inside if p.message >= 0]
        if content:
            p = content[0]
            stats["content"] += 1
            content_tokens[p.message] += 1
            assert (got.role, got.modality) == (p.role, p.modality), where(t)
            assert tags.message_index[t] == p.message, where(t)
            assert got.temporal == bucket(p.message), where(t)
            assert tags.actionable[t] == (p.message in actionable), where(t)
            continue
        if overlap:  # a token merging template text with a message part: either is fine
            stats["straddle"] += 1
            assert got.role in {overlap[0].role, Role.DELIM, Role.INST}, where(t)
            continue
        stats["scaffold"] += 1
        is_marker = any(p.marker for p in inside)
        if tags.token_ids[t] in specials or is_marker:
            assert got.role is Role.DELIM, where(t)
        elif e <= ref.system_end:
            assert got.role is Role.INST, where(t)
        else:
            assert got.role is Role.DELIM, where(t)
        if s >= ref.messages_end:
            assert tags.message_index[t] == -1 and got.temporal is Temporal.CURRENT, where(t)
    # structure: system block, tail, actionable span
    assert tags.protected_prefix == sum(1 for s, _ in offsets if s < ref.system_end)
    tail = [t for t, (s, _) in enumerate(offsets) if s >= ref.messages_end]
    assert tags.tail_start == (tail[0] if tail and gen else len(offsets))
    assert all(tags.message_index[t] == -1 for t in range(tags.tail_start, len(offsets)))
    added_block = roles[0] != "system"  # a template-added system block belongs to no message
    for t in range(tags.tail_start):
        if added_block and t < tags.protected_prefix:
            assert tags.message_index[t] == -1 and not tags.actionable[t], where(t)
            continue
        assert tags.message_index[t] >= 0
        assert tags.actionable[t] == (tags.message_index[t] in actionable)
    # each message's closing <|im_end|> is its own: owner, turn bucket, actionable flag
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    closing = {s: t for t, (s, _) in enumerate(offsets) if tags.token_ids[t] == im_end}
    for s, i in ref.closers.items():
        t = closing[s]
        assert tags.message_index[t] == i, where(t)
        assert unpacked(tags.codes[t]).temporal == bucket(i), where(t)
        assert tags.actionable[t] == (i in actionable), where(t)
    assert tags.forced(True) == [
        tags.actionable[t] or t >= tags.tail_start or t < tags.protected_prefix
        for t in range(len(offsets))
    ]
    return tags, stats


# --------------------------------------------------------------------------- messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_user_details",
            "description": "Get the details of a user.",
            "parameters": {
                "type": "object",
                "properties": {"user_id": {"type": "string"}},
                "required": ["user_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_direct_flight",
            "description": "Search direct flights between two cities on a date.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string"},
                    "destination": {"type": "string"},
                    "date": {"type": "string"},
                },
            },
        },
    },
]


def call(name: str, args: dict, cid: str) -> dict:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def conversation() -> list[dict]:
    """Two user turns, a reasoning assistant with two parallel tool calls, two tool results."""
    return [
        {"role": "system", "content": "You are an airline agent. Be brief and exact."},
        {"role": "user", "content": "Hi, I want to fly from New York to Seattle on May 20."},
        {"role": "assistant", "content": "Sure. What is your user id?"},
        {"role": "user", "content": "It is mia_li_3668."},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Look up the user, then search flights.",
            "tool_calls": [
                call("get_user_details", {"user_id": "mia_li_3668"}, "c1"),
                call(
                    "search_direct_flight",
                    {"origin": "JFK", "destination": "SEA", "date": "2024-05-20"},
                    "c2",
                ),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"name": "Mia Li", "tier": "gold"}'},
        {"role": "tool", "tool_call_id": "c2", "content": '[{"flight": "HAT011", "price": 299}]'},
    ]


def token_texts(tok, tags: TokenTags, role: Role) -> str:
    ids = [i for i, c in zip(tags.token_ids, tags.codes, strict=True) if TagCode.role_of(c) is role]
    return tok.decode(ids)


# ------------------------------------------------------------------------------ tests


def test_roles_on_a_tool_conversation(kind_tok):
    kind, tok = kind_tok
    msgs = conversation()
    tags, stats = check_against_reference(kind, tok, msgs, TOOLS)
    assert stats["content"] > 50
    # spot checks, readable: which text each role got
    assert "mia_li_3668" in token_texts(tok, tags, Role.TOOL_CALL)
    assert "search_direct_flight" in token_texts(tok, tags, Role.TOOL_CALL)
    assert "HAT011" in token_texts(tok, tags, Role.OBS)
    assert token_texts(tok, tags, Role.REASONING).strip() == (
        "Look up the user, then search flights."
    )
    inst = token_texts(tok, tags, Role.INST)
    assert "You are an airline agent." in inst and '"get_user_details"' in inst
    delim_ids = [
        i
        for i, c in zip(tags.token_ids, tags.codes, strict=True)
        if TagCode.role_of(c) is Role.DELIM
    ]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert delim_ids.count(im_start) == tags.token_ids.count(im_start)
    if kind == "qwen3":  # single added tokens, delim wherever they are scaffolding
        for name in ("<think>", "<tool_call>", "<tool_response>"):
            tid = tok.convert_tokens_to_ids(name)
            assert tid in delim_ids
            assert all(
                TagCode.role_of(c) is Role.DELIM
                for i, c in zip(tags.token_ids, tags.codes, strict=True)
                if i == tid
            )
    # actionable = both trailing tool results (and their scaffolding), tail = generation prompt
    owners = {tags.message_index[t] for t in range(len(tags)) if tags.actionable[t]}
    assert owners == {5, 6}
    assert tok.decode(tags.token_ids[tags.tail_start :]) == "<|im_start|>assistant\n"
    # temporal: turn 0 is one turn old, turn 1 is current
    first_user = [
        TagCode.unpack(c).temporal
        for c, o in zip(tags.codes, tags.message_index, strict=True)
        if o == 1 and TagCode.role_of(c) is Role.USER
    ]
    assert set(first_user) == {Temporal.TURN_M1}


def test_temporal_buckets_and_user_actionable(kind_tok):
    kind, tok = kind_tok
    msgs = [{"role": "system", "content": "Be helpful."}]
    for k in range(5):
        msgs += [
            {"role": "user", "content": f"Question number {k}?"},
            {"role": "assistant", "content": f"Answer number {k}."},
        ]
    msgs.append({"role": "user", "content": "And the last question?"})
    tags, _ = check_against_reference(kind, tok, msgs, None)
    by_msg = {}
    for c, o in zip(tags.codes, tags.message_index, strict=True):
        by_msg.setdefault(o, set()).add(TagCode.unpack(c).temporal)
    assert by_msg[11] == {Temporal.CURRENT}
    assert by_msg[10] == {Temporal.TURN_M1} and by_msg[9] == {Temporal.TURN_M1}
    assert by_msg[8] == {Temporal.TURN_M2}
    assert by_msg[1] == {Temporal.OLDER} and by_msg[0] == {Temporal.OLDER}
    assert by_msg[-1] == {Temporal.CURRENT}
    assert {tags.message_index[t] for t in range(len(tags)) if tags.actionable[t]} == {11}
    # no tools: the system block is the system message's own block
    assert tok.decode(tags.token_ids[: tags.protected_prefix]) == (
        "<|im_start|>system\nBe helpful.<|im_end|>\n"
    )


def test_protected_prefix_is_exactly_the_system_block(kind_tok):
    kind, tok = kind_tok
    r = renderer_for(kind, tok)
    msgs = conversation()
    tags = r.encode(msgs, TOOLS)
    block = r.render([msgs[0]], TOOLS, add_generation_prompt=False)
    assert tags.text.startswith(block)
    assert tok.decode(tags.token_ids[: tags.protected_prefix]) == block
    # without a system message, the tool block is still the protected prefix
    tags = r.encode(msgs[1:], TOOLS)
    assert tok.decode(tags.token_ids[: tags.protected_prefix]).endswith("</tool_call><|im_end|>\n")
    assert {TagCode.role_of(c) for c in tags.codes[: tags.protected_prefix]} == {
        Role.INST,
        Role.DELIM,
    }
    # ... and it is no message's text: on a first turn the user message alone is the
    # actionable query, so without prefix protection the tool block may go (BFCL's first turns)
    tags = r.encode(msgs[1:2], TOOLS)
    first_user = [t for t in range(len(tags)) if tags.message_index[t] == 0]
    assert first_user[0] == tags.protected_prefix
    assert tok.decode([tags.token_ids[t] for t in first_user]).startswith("<|im_start|>user")
    assert not any(tags.actionable[: tags.protected_prefix])
    assert [t for t, f in enumerate(tags.forced(False)) if f and t < tags.tail_start] == first_user
    # neither system message nor tools: nothing is protected
    assert r.encode(msgs[1:2]).protected_prefix == 0


def test_reasoning_of_the_latest_turn_only_on_qwen(qwen):
    msgs = conversation()[:5]
    msgs[2] = dict(msgs[2], reasoning_content="Need the user id first.")
    msgs.append({"role": "user", "content": "Thanks."})
    tags, _ = check_against_reference("qwen3", qwen, msgs, TOOLS)
    # the template drops reasoning of turns before the latest user query
    assert Role.REASONING.name.lower() not in tags.role_counts()
    assert "Need the user id first" not in tags.text
    # ... and renders it for assistant turns after it
    tags, _ = check_against_reference("qwen3", qwen, msgs[:-1] + [], TOOLS)
    assert token_texts(qwen, tags, Role.REASONING).strip() == (
        "Look up the user, then search flights."
    )


def test_image_placeholder_has_image_modality(kind_tok):
    kind, tok = kind_tok
    msgs = [
        {"role": "system", "content": "You see screenshots."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is on this page?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "text", "text": " Click the blue button."},
            ],
        },
    ]
    tags, _ = check_against_reference(kind, tok, msgs, None)
    image = [t for t, c in enumerate(tags.codes) if TagCode.unpack(c).modality is Modality.IMAGE]
    # (a token merging "?" with "<" may go either way)
    assert image and tok.decode([tags.token_ids[t] for t in image]) in IMAGE_PLACEHOLDER
    assert "image" in tok.decode([tags.token_ids[t] for t in image])
    assert all(TagCode.role_of(tags.codes[t]) is Role.USER for t in image)


@pytest.mark.parametrize(
    "case",
    [
        "empty_tool_result",
        "empty_tool_result_middle",
        "content_equals_role_name",
        "content_is_scaffolding_text",
        "special_token_text",
        "inline_think",
        "padded_newlines",
        "repeated_content",
        "user_wraps_tool_response",
    ],
)
def test_hard_contents(kind_tok, case):
    """Contents the template transforms, contents that look like scaffolding, empty ones."""
    kind, tok = kind_tok
    msgs = conversation()
    if case == "empty_tool_result":
        msgs[-1] = dict(msgs[-1], content="")
    elif case == "empty_tool_result_middle":
        msgs[-2] = dict(msgs[-2], content="")
    elif case == "content_equals_role_name":
        msgs[3] = dict(msgs[3], content="user")
        msgs[2] = dict(msgs[2], content="assistant")
    elif case == "content_is_scaffolding_text":
        msgs[-1] = dict(msgs[-1], content="response")
        msgs[-2] = dict(msgs[-2], content="\n")
    elif case == "special_token_text":
        msgs[3] = dict(msgs[3], content="Print <|im_end|> and <|im_start|>user literally.")
    elif case == "inline_think":
        msgs[2] = {"role": "assistant", "content": "<think>\nId needed.\n</think>\n\nYour id?"}
        msgs = msgs[:3] + [{"role": "user", "content": "Why?"}]
    elif case == "padded_newlines":
        msgs[4] = dict(msgs[4], reasoning_content="\n\nLook it up.\n")
    elif case == "user_wraps_tool_response":
        # Qwen3's template then looks further back for the latest query: its scaffolding
        # depends on this content, so the tagger falls back to searching for the pieces
        msgs = msgs[:5] + [{"role": "user", "content": "<tool_response>\nok\n</tool_response>"}]
    elif case == "repeated_content":
        msgs[2] = dict(msgs[2], content="It is mia_li_3668.")  # the next user says the same
    if case == "inline_think":
        # the renderer hands the template reasoning_content, not inline <think> text
        from agentkv.engine.chat_template import normalise_message

        norm = normalise_message(msgs[2])
        assert norm["reasoning_content"] == "Id needed." and norm["content"] == "Your id?"
        ref_msgs = msgs[:2] + [norm] + msgs[3:]
    else:
        ref_msgs = msgs
    tags = encode(kind, tok, msgs, TOOLS)
    ref = render_reference(ref_msgs, TOOLS, kind)
    assert tags.text == ref.text
    if case == "inline_think" and kind == "qwen3":
        pass  # reasoning before the latest user query is not rendered
    elif case == "inline_think":
        assert token_texts(tok, tags, Role.REASONING).strip() == "Id needed."
    _check_ref_tags(kind, tok, ref_msgs, TOOLS, tags)
    if case.startswith("empty_tool_result"):
        # an empty tool result still owns its own scaffolding (and is actionable)
        i = len(msgs) - 1 if case == "empty_tool_result" else len(msgs) - 2
        own = [t for t in range(len(tags)) if tags.message_index[t] == i]
        assert own and all(tags.actionable[t] for t in own)
        assert "<tool_response>" in tok.decode([tags.token_ids[t] for t in own])


def _check_ref_tags(kind, tok, msgs, tools, tags):
    got = encode(kind, tok, msgs, tools)
    assert got.codes == tags.codes
    check_against_reference(kind, tok, msgs, tools)


def test_search_fallback_agrees_with_alignment(kind_tok):
    """Without the renderer's piece spans the tagger searches for the pieces in order: on an
    ordinary conversation it must land on the same tags."""
    from agentkv.annotation import openai_view
    from agentkv.token_tagger import tag_tokens

    kind, tok = kind_tok
    r = renderer_for(kind, tok)
    msgs = conversation()
    exact = r.encode(msgs, TOOLS)
    bare = r.render([_norm(m) for m in msgs], TOOLS, add_generation_prompt=False)
    block = r.render([_norm(msgs[0])], TOOLS, add_generation_prompt=False)
    searched = tag_tokens(
        exact.text,
        [openai_view(m) for m in msgs],
        tok,
        messages_end=len(bare),
        system_end=len(block),
    )
    assert searched == exact
    # without system_end the system block ends where the first user message's share starts:
    # after the system block's own closing token, so the guess is exact
    guessed = tag_tokens(exact.text, msgs, tok, messages_end=len(bare))
    assert guessed == exact
    assert tok.decode(guessed.token_ids[: guessed.protected_prefix]).endswith(
        "</tool_call><|im_end|>\n"
    )


def _norm(m):
    from agentkv.engine.chat_template import normalise_message

    return normalise_message(m)


def test_annotations_from_client_or_derived_give_identical_tags(kind_tok, tau):
    kind, tok = kind_tok
    for trace in tau[:4]:
        msgs = trace.messages[:12]
        payload = decode_payload(encode_payload(build_payload(msgs, _intentkv(), "x:tagger")))
        client = encode(kind, tok, msgs, trace.tools[:3], payload.messages)
        derived = encode(kind, tok, msgs, trace.tools[:3])
        assert client == derived
        assert client == encode(kind, tok, msgs, trace.tools[:3], annotate_messages(msgs))


def _intentkv():
    from agentkv.policies import IntentKV

    return IntentKV(budget=64)


def _request_prefixes(messages):
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i > 1:
            yield messages[:i]


def test_real_tau_bench_traces(kind_tok, tau):
    """Every request of real multi-turn airline trajectories: each message's content tokens
    carry its role, no content token is left as delim, scaffolding is delim/inst."""
    kind, tok = kind_tok
    checked = empty = 0
    for trace in tau:
        msgs = copy.deepcopy(trace.messages)
        prefixes = list(_request_prefixes(msgs))
        for prefix in prefixes[:: max(1, len(prefixes) // 3)][:3] + prefixes[-1:]:
            tags, stats = check_against_reference(kind, tok, prefix, trace.tools)
            assert stats["content"] > 0
            counts = tags.role_counts()
            assert counts.get("inst", 0) > 0 and counts.get("user", 0) > 0
            empty += sum(1 for m in prefix if m["role"] == "tool" and not m["content"])
            checked += 1
    assert checked >= 30
    assert empty > 0  # the sample includes empty tool results
