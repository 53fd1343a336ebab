"""Message annotation on real multi-turn traces (tau-bench, BFCL) and LangChain messages."""

from __future__ import annotations

import copy
import json

import pytest

from agentkv.annotation import (
    MessageAnnotation,
    actionable_span,
    annotate_messages,
    current_turn,
    openai_view,
)
from agentkv.tags import Modality, Role

SEMANTIC = {"system": Role.INST, "user": Role.USER, "assistant": Role.ASSISTANT, "tool": Role.OBS}


# ----------------------------------------------------------------- reference definitions


def expected_turns(roles: list[str]) -> list[int]:
    """A turn starts at each user message; everything before the first user message is turn 0."""
    out, users = [], 0
    for r in roles:
        users += r == "user"
        out.append(max(users - 1, 0))
    return out


def expected_actionable(roles: list[str]) -> list[int]:
    """Latest user/tool message; if it is a tool result, the whole trailing run of them."""
    last = max((i for i, r in enumerate(roles) if r in {"user", "tool"}), default=None)
    if last is None:
        return []
    if roles[last] == "user":
        return [last]
    first = last
    while first > 0 and roles[first - 1] == "tool":
        first -= 1
    return list(range(first, last + 1))


def request_prefixes(messages: list[dict]):
    """The message lists an agent sends: everything before each assistant reply."""
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i > 0:
            yield messages[:i]


def check_basic(messages: list[dict], anns: list[MessageAnnotation]) -> None:
    roles = [m["role"] for m in messages]
    assert [a.index for a in anns] == list(range(len(messages)))
    assert [a.role for a in anns] == roles
    assert [a.turn for a in anns] == expected_turns(roles)
    assert actionable_span(anns) == expected_actionable(roles)
    assert current_turn(anns) == max(expected_turns(roles), default=0)
    for m, a in zip(messages, anns, strict=True):
        assert a.semantic is SEMANTIC[m["role"]]
        calls = m.get("tool_calls") or []
        assert a.num_tool_calls == len(calls)
        text = m.get("content")
        body = [p for p in a.parts if p.semantic is a.semantic]
        if isinstance(text, str):
            assert [p.chars for p in body] == ([len(text)] if text else [])
        for p, c in zip([p for p in a.parts if p.semantic is Role.TOOL_CALL], calls, strict=True):
            assert p.chars == len(c["function"]["name"]) + len(c["function"]["arguments"])
        assert a.name == (m.get("name") if m["role"] == "tool" else None)
        assert a.modalities <= {Modality.TEXT}
        assert not a.has_reasoning


# ----------------------------------------------------------------- tau-bench (real GPT-4o)


def test_tau_bench_full_trajectories(tau_trajs):
    assert len(tau_trajs) == 200
    for traj in tau_trajs:
        anns = annotate_messages(traj)
        check_basic(traj, anns)
        # the system policy prompt is turn 0 and never actionable
        assert anns[0].role == "system" and anns[0].turn == 0 and not anns[0].actionable
        first_user = next(a for a in anns if a.role == "user")
        assert first_user.turn == 0


def test_tau_bench_turns_count_user_messages(tau_trajs):
    for traj in tau_trajs:
        anns = annotate_messages(traj)
        n_users = sum(m["role"] == "user" for m in traj)
        assert current_turn(anns) == n_users - 1
        # turn indices step by one exactly at user messages after the first one
        first_user = next(i for i, m in enumerate(traj) if m["role"] == "user")
        for prev, cur in zip(anns, anns[1:], strict=False):
            starts = cur.role == "user" and cur.index > first_user
            assert cur.turn - prev.turn == (1 if starts else 0)


def test_tau_bench_every_request_prefix(tau_trajs):
    """Each request an agent would send (prefix before an assistant reply) is annotated right:
    the actionable query is the user message or the tool result(s) that the reply answers."""
    n_user, n_tool = 0, 0
    for traj in tau_trajs[::4]:  # one trial per task: 50 trajectories, ~600 requests
        for prefix in request_prefixes(traj):
            anns = annotate_messages(prefix)
            check_basic(prefix, anns)
            span = actionable_span(anns)
            assert span[-1] == len(prefix) - 1 or prefix[-1]["role"] == "assistant"
            if prefix[-1]["role"] == "tool":
                n_tool += 1
                assert all(prefix[i]["role"] == "tool" for i in span)
            elif prefix[-1]["role"] == "user":
                n_user += 1
                assert span == [len(prefix) - 1]
    assert n_user > 100 and n_tool > 100


def test_tau_bench_trailing_assistant_keeps_last_query_actionable(tau_trajs):
    # the file's trajectories end on a user or tool message; cut each after its last reply
    assert {t[-1]["role"] for t in tau_trajs} == {"user", "tool"}
    cut = [t[: max(i for i, m in enumerate(t) if m["role"] == "assistant") + 1] for t in tau_trajs]
    for traj in cut[:40]:
        anns = annotate_messages(traj)
        last_query = max(i for i, m in enumerate(traj) if m["role"] in {"user", "tool"})
        assert last_query in actionable_span(anns)
        assert not anns[-1].actionable


def _merge_parallel(traj: list[dict]) -> list[dict] | None:
    """Turn two consecutive (call, result) steps of a real trajectory into one parallel step."""
    for i in range(len(traj) - 3):
        a, r1, b, r2 = traj[i : i + 4]
        if (a["role"], r1["role"], b["role"], r2["role"]) == (
            "assistant",
            "tool",
            "assistant",
            "tool",
        ):
            if a["tool_calls"][0]["id"] == b["tool_calls"][0]["id"]:
                continue  # tau-bench reuses ids now and then; keep the merged ones distinct
            merged = copy.deepcopy(a)
            merged["tool_calls"] = a["tool_calls"] + b["tool_calls"]
            return traj[:i] + [merged, r1, r2]
    return None


def test_parallel_tool_results_are_all_actionable(tau_trajs):
    n = 0
    for traj in tau_trajs:
        req = _merge_parallel(traj)
        if req is None:
            continue
        anns = annotate_messages(req)
        assert actionable_span(anns) == [len(req) - 2, len(req) - 1]
        assert anns[-3].num_tool_calls == 2
        assert not anns[-3].actionable
        n += 1
    assert n > 50


def test_tau_bench_tool_results_and_calls(tau_trajs):
    names = set()
    for traj in tau_trajs[:40]:
        anns = annotate_messages(traj)
        for m, a in zip(traj, anns, strict=True):
            if m["role"] == "tool":
                assert a.semantic is Role.OBS and a.name == m["name"]
                names.add(a.name)
                if m["content"] == "":  # the `think` tool answers with an empty string
                    assert a.parts == []
            if m["role"] == "assistant" and m.get("tool_calls"):
                text = [Role.ASSISTANT] if m["content"] else []
                assert [p.semantic for p in a.parts] == text + [Role.TOOL_CALL]
    assert {"get_user_details", "get_reservation_details", "think"} <= names


def test_node_is_recorded(tau_trajs):
    anns = annotate_messages(tau_trajs[0][:5], node="agent")
    assert {a.node for a in anns} == {"agent"}
    assert {a.node for a in annotate_messages(tau_trajs[0][:5])} == {None}


# ----------------------------------------------------------------- BFCL (executed)


def test_bfcl_turns_follow_the_benchmark_turns(bfcl_base):
    assert len(bfcl_base) == 200
    for trace in bfcl_base:
        anns = annotate_messages(trace.messages)
        check_basic(trace.messages, anns)
        assert current_turn(anns) == trace.meta["num_turns"] - 1
        user_turns = [a.turn for a in anns if a.role == "user"]
        assert user_turns == list(range(trace.meta["num_turns"]))


def test_bfcl_request_prefixes(bfcl_base):
    for trace in bfcl_base[:30]:
        for prefix in request_prefixes(trace.messages):
            check_basic(prefix, annotate_messages(prefix))


def test_bfcl_missed_function_turn(bfcl_miss_func):
    from agentkv.bench.bfcl_traces import ADDED_FUNCTIONS_PROMPT

    for trace in bfcl_miss_func:
        anns = annotate_messages(trace.messages)
        added = [
            a.turn
            for m, a in zip(trace.messages, anns, strict=True)
            if m.get("content") == ADDED_FUNCTIONS_PROMPT
        ]
        assert added == [int(k) for k in trace.meta["missed_function"]]


# ----------------------------------------------------------------- content blocks


def test_reasoning_content_and_blocks():
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm"},
                {"type": "reasoning", "reasoning": "abc"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
                {"type": "text", "text": "four"},
            ],
        },
    ]
    a = annotate_messages(msgs)
    assert [(p.semantic, p.chars) for p in a[1].parts] == [
        (Role.REASONING, 12),
        (Role.ASSISTANT, 1),
    ]
    assert [(p.semantic, p.chars) for p in a[2].parts] == [
        (Role.REASONING, 3),
        (Role.REASONING, 3),
        (Role.REASONING, 3),
        (Role.ASSISTANT, 4),
    ]
    assert a[1].has_reasoning and a[2].has_reasoning and not a[0].has_reasoning
    assert a[1].semantic is Role.ASSISTANT  # the message body; reasoning lives in parts


@pytest.mark.parametrize(
    "block",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "image", "url": "https://example.com/a.png"},
        {"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"},
        {"type": "input_image", "image_url": "https://example.com/a.png"},
    ],
)
@pytest.mark.parametrize("role, semantic", [("user", Role.USER), ("tool", Role.OBS)])
def test_image_blocks(block, role, semantic):
    msg = {"role": role, "content": [{"type": "text", "text": "see"}, block]}
    if role == "tool":
        msg |= {"tool_call_id": "c1", "name": "screenshot"}
    (a,) = annotate_messages([msg])
    assert [(p.semantic, p.modality, p.chars) for p in a.parts] == [
        (semantic, Modality.TEXT, 3),
        (semantic, Modality.IMAGE, 0),
    ]
    assert a.modalities == {Modality.TEXT, Modality.IMAGE}
    assert a.actionable


def test_tool_use_blocks_duplicated_in_tool_calls_count_once():
    """Anthropic-style content carries tool_use blocks that tool_calls repeats (same id)."""
    msg = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "checking"},
            {"type": "tool_use", "id": "t1", "name": "get", "input": {"a": 1}},
        ],
        "tool_calls": [{"id": "t1", "name": "get", "args": {"a": 1}, "type": "tool_call"}],
    }
    (a,) = annotate_messages([msg])
    assert a.num_tool_calls == 1
    # only in content (no tool_calls): still counted once
    (b,) = annotate_messages([{k: v for k, v in msg.items() if k != "tool_calls"}])
    assert b.num_tool_calls == 1
    assert a.parts == b.parts == annotate_messages([msg])[0].parts


def test_string_blocks_and_unknown_block_types():
    (a,) = annotate_messages([{"role": "user", "content": ["ab", {"type": "text", "text": "cde"}]}])
    assert [p.chars for p in a.parts] == [2, 3]
    (b,) = annotate_messages([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert [(p.semantic, p.chars) for p in b.parts] == [(Role.USER, 0)]


def test_developer_and_function_roles():
    anns = annotate_messages(
        [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "f", "arguments": "{}"},
            },
            {"role": "function", "name": "f", "content": "42"},
        ]
    )
    assert [a.semantic for a in anns] == [Role.INST, Role.USER, Role.ASSISTANT, Role.OBS]
    assert actionable_span(anns) == [3]
    assert anns[3].name == "f"


def test_empty_conversation():
    assert annotate_messages([]) == []
    assert actionable_span([]) == []
    assert current_turn([]) == 0


def test_no_user_message_means_turn_zero_and_no_actionable():
    anns = annotate_messages(
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    )
    assert [a.turn for a in anns] == [0, 0]
    assert actionable_span(anns) == []


@pytest.mark.parametrize(
    "messages, exc, text",
    [
        ([{"content": "no role"}], ValueError, "message 0: message has no 'role'"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}],
            ValueError,
            "message 1: unknown role 'robot'",
        ),
        ([{"role": ["user"], "content": "x"}], ValueError, "message 0: unknown role"),
        (
            [{"role": "user", "content": [1]}],
            TypeError,
            "message 0: content block must be a dict or str",
        ),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
            TypeError,
            "message 1: content must be a string or a list",
        ),
        (
            [{"role": "assistant", "content": None, "tool_calls": ["oops"]}],
            ValueError,
            "message 0:",
        ),
        ([42], TypeError, "message 0: cannot annotate int"),
        ([object()], TypeError, "expected an OpenAI message dict or a LangChain message"),
    ],
)
def test_malformed_messages_name_the_message(messages, exc, text):
    with pytest.raises(exc, match=text.replace("(", r"\(").replace("[", r"\[")):
        annotate_messages(messages)


def test_openai_view_is_a_copy():
    m = {"role": "user", "content": "x"}
    v = openai_view(m)
    v["content"] = "changed"
    assert m["content"] == "x"


def test_annotations_are_frozen_and_json_round_trip(tau_trajs):
    anns = annotate_messages(tau_trajs[0])
    with pytest.raises(ValueError):
        anns[0].turn = 5
    dumped = [json.loads(a.model_dump_json()) for a in anns]
    assert dumped[0]["semantic"] == "inst" and dumped[1]["semantic"] == "user"
    assert [MessageAnnotation.model_validate(d) for d in dumped] == anns


# ----------------------------------------------------------------- LangChain messages

lc = pytest.importorskip("langchain_core.messages")


def test_langchain_conversion_of_real_trajectories_annotates_identically(tau_trajs):
    """tau-bench dicts -> LangChain messages: same annotations as the OpenAI dicts LangChain
    itself would send, and the same as the originals up to tool-call argument spacing."""
    for traj in tau_trajs[::5]:
        msgs = lc.convert_to_messages(traj)
        assert {type(m).__name__ for m in msgs} <= {
            "SystemMessage",
            "HumanMessage",
            "AIMessage",
            "ToolMessage",
        }
        got = annotate_messages(msgs)
        assert got == annotate_messages(lc.convert_to_openai_messages(msgs))
        orig = annotate_messages(traj)
        for g, o in zip(got, orig, strict=True):
            assert g.model_dump(exclude={"parts"}) == o.model_dump(exclude={"parts"})
            assert [p.semantic for p in g.parts] == [p.semantic for p in o.parts]
            assert [p.chars for p in g.parts if p.semantic is not Role.TOOL_CALL] == [
                p.chars for p in o.parts if p.semantic is not Role.TOOL_CALL
            ]


def test_langchain_messages_match_openai_dicts():
    args = {"city": "Zürich", "days": 3}
    lc_msgs = [
        lc.SystemMessage("You are a weather bot."),
        lc.HumanMessage(
            content=[
                {"type": "text", "text": "What is this?"},
                {"type": "image", "url": "https://example.com/sky.png"},
            ]
        ),
        lc.AIMessage(
            content=[
                {"type": "reasoning", "reasoning": "look it up"},
                {"type": "text", "text": "Checking."},
            ],
            tool_calls=[
                {"name": "forecast", "args": args, "id": "c1"},
                {"name": "radar", "args": {}, "id": "c2"},
            ],
        ),
        lc.ToolMessage("sunny", tool_call_id="c1", name="forecast"),
        lc.ToolMessage(
            content=[{"type": "image", "base64": "iVBORw0KGgo=", "mime_type": "image/png"}],
            tool_call_id="c2",
            name="radar",
        ),
    ]
    oa_msgs = [
        {"role": "system", "content": "You are a weather bot."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/sky.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "reasoning", "reasoning": "look it up"},
                {"type": "text", "text": "Checking."},
            ],
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {
                        "name": "forecast",
                        "arguments": json.dumps(args, ensure_ascii=False),
                    },
                },
                {"id": "c2", "type": "function", "function": {"name": "radar", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "forecast", "content": "sunny"},
        {
            "role": "tool",
            "tool_call_id": "c2",
            "name": "radar",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
            ],
        },
    ]
    got, want = annotate_messages(lc_msgs, node="n"), annotate_messages(oa_msgs, node="n")
    assert got == want
    assert [a.semantic for a in got] == [Role.INST, Role.USER, Role.ASSISTANT, Role.OBS, Role.OBS]
    assert got[1].modalities == {Modality.TEXT, Modality.IMAGE}
    assert got[2].has_reasoning and got[2].num_tool_calls == 2
    assert got[4].modalities == {Modality.IMAGE}
    assert actionable_span(got) == [3, 4]


def test_langchain_reasoning_content_in_additional_kwargs():
    msg = lc.AIMessage("4", additional_kwargs={"reasoning_content": "2+2"})
    (a,) = annotate_messages([msg])
    (b,) = annotate_messages([{"role": "assistant", "content": "4", "reasoning_content": "2+2"}])
    assert a == b
    assert [(p.semantic, p.chars) for p in a.parts] == [(Role.REASONING, 3), (Role.ASSISTANT, 1)]


def test_langchain_v1_tool_call_blocks_are_not_double_counted():
    msg = lc.AIMessage(
        content=[
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "c3", "name": "get", "input": {"a": 1}},
        ],
        tool_calls=[{"name": "get", "args": {"a": 1}, "id": "c3"}],
    )
    (a,) = annotate_messages([msg])
    assert a.num_tool_calls == 1
    assert [p.chars for p in a.parts] == [2, len("get") + len('{"a": 1}')]


def test_langchain_chunks():
    chunks = [
        lc.SystemMessageChunk(content="s"),
        lc.HumanMessageChunk(content="hi"),
        lc.AIMessageChunk(
            content="", tool_call_chunks=[{"name": "f", "args": '{"x": 1}', "id": "c", "index": 0}]
        ),
        lc.ToolMessageChunk(content="ok", tool_call_id="c"),
    ]
    anns = annotate_messages(chunks)
    assert [a.role for a in anns] == ["system", "user", "assistant", "tool"]
    assert anns[2].num_tool_calls == 1
    assert actionable_span(anns) == [3]


def test_langchain_and_dict_messages_can_mix(tau_trajs):
    traj = tau_trajs[3]
    mixed = [lc.convert_to_messages([m])[0] if i % 2 else m for i, m in enumerate(traj)]
    got = annotate_messages(mixed)
    assert [a.turn for a in got] == [a.turn for a in annotate_messages(traj)]
    assert actionable_span(got) == actionable_span(annotate_messages(traj))
