"""Trace loaders on real data: tau-bench trajectories, executed BFCL examples, JSONL files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.annotation import actionable_span, annotate_messages, current_turn
from agentkv.bench import bfcl_traces as B
from agentkv.bench import traces as T
from agentkv.bench.traces import (
    Trace,
    TraceFormatError,
    check_tool_calls,
    load_jsonl,
    load_source,
    load_tau_bench,
    sample,
)

jsonschema = pytest.importorskip("jsonschema")


def _calls(trace: Trace):
    """(call, result text) pairs of a trace, in order."""
    results = {}
    pairs = []
    for m in trace.messages:
        for c in m.get("tool_calls") or ():
            pairs.append(c)
        if m["role"] == "tool":
            results.setdefault(m["tool_call_id"], []).append(m["content"])
    out = []
    for c in pairs:
        out.append(
            (c["function"]["name"], json.loads(c["function"]["arguments"]), results[c["id"]].pop(0))
        )
    return out


_VALIDATORS: dict[str, object] = {}


def _validator(schema: dict):
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft202012Validator(schema)
    return _VALIDATORS[key]


def check_trace(trace: Trace, schema_exceptions: frozenset[str] = frozenset()) -> None:
    assert trace.id and trace.source
    assert all(isinstance(m, dict) and "role" in m for m in trace.messages)
    check_tool_calls(trace.messages)
    anns = annotate_messages(trace.messages)
    assert len(anns) == len(trace.messages)
    assert actionable_span(anns)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in trace.tools or ()}
    assert all(t["type"] == "function" for t in trace.tools or ())
    for name, args, _ in _calls(trace):
        assert name in tools, f"{trace.id}: call to {name} has no tool schema"
        if name not in schema_exceptions:
            _validator(tools[name]).validate(args)


# ----------------------------------------------------------------- tau-bench


@pytest.fixture(scope="module")
def tau() -> list[Trace]:
    try:
        return load_tau_bench()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_tau_bench_loads_all_and_is_valid(tau):
    assert len(tau) == 200
    assert len({t.id for t in tau}) == 200
    assert tau[0].id == "tau-bench/airline/0/0" and tau[-1].id == "tau-bench/airline/49/3"
    for t in tau:
        assert t.source == "tau-bench"
        assert t.messages[0]["role"] == "system"
        check_trace(t)
    assert sum(t.num_tool_calls for t in tau) == 1164


def test_tau_bench_inferred_tool_schemas(tau):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in tau[0].tools}
    assert set(tools) == {n for t in tau for n, _, _ in _calls(t)}
    assert len(tools) == 14
    assert tools["get_user_details"] == {
        "type": "object",
        "properties": {"user_id": {"type": "string"}},
        "required": ["user_id"],
    }
    book = tools["book_reservation"]
    assert book["properties"]["flights"]["items"]["properties"] == {
        "flight_number": {"type": "string"},
        "date": {"type": "string"},
    }
    assert book["properties"]["total_baggages"] == {"type": "integer"}
    assert tools["list_all_airports"]["properties"] == {}
    # every trace carries the same list, as copies
    assert all(t.tools == tau[0].tools for t in tau)
    assert tau[0].tools is not tau[1].tools


def test_schema_inference_merges():
    a = T.infer_schema({"x": 1, "y": [{"p": "a"}], "z": None})
    b = T.infer_schema({"x": 2.5, "y": [{"p": "b", "q": True}]})
    m = T.merge_schemas(a, b)
    assert m["required"] == ["x", "y"]
    assert m["properties"]["x"] == {"type": "number"}
    assert m["properties"]["z"] == {"type": "null"}
    assert m["properties"]["y"]["items"]["required"] == ["p"]
    assert m["properties"]["y"]["items"]["properties"]["q"] == {"type": "boolean"}
    assert T.merge_schemas({"type": "string"}, {"type": "integer"}) == {
        "type": ["integer", "string"]
    }
    assert T.infer_schema([]) == {"type": "array"}


def test_tau_bench_sampling_is_deterministic(tau):
    a = load_tau_bench(limit=10, seed=0)
    assert [t.id for t in a] == [t.id for t in load_tau_bench(limit=10, seed=0)]
    b = load_tau_bench(limit=10, seed=1)
    assert [t.id for t in a] != [t.id for t in b]
    ids = [t.id for t in tau]
    assert all(t.id in ids for t in a)
    assert [t.id for t in a] == sorted((t.id for t in a), key=ids.index)  # in id order
    assert load_tau_bench(limit=0) == []
    assert len(load_tau_bench(limit=1000)) == 200


def test_tau_bench_env_override_and_missing(tmp_path, monkeypatch, tau_items_small):
    path = tmp_path / "tiny-retail.json"
    path.write_text(json.dumps(tau_items_small))
    monkeypatch.setenv(T.TAU_BENCH_ENV, str(path))
    traces = load_tau_bench()
    assert [t.id for t in traces] == [
        f"tau-bench/retail/{i['task_id']}/{i['trial']}" for i in tau_items_small
    ]
    monkeypatch.setenv(T.TAU_BENCH_ENV, str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="AGENTKV_TAU_BENCH"):
        load_tau_bench()
    with pytest.raises(FileNotFoundError, match="nope2.json"):
        load_tau_bench(tmp_path / "nope2.json")


@pytest.fixture
def tau_items_small(tau) -> list[dict]:
    return [
        {"task_id": t.meta["task_id"], "trial": t.meta["trial"], "reward": 1.0, "traj": t.messages}
        for t in tau[:3]
    ]


# ----------------------------------------------------------------- BFCL

HAVE_BFCL = importlib.util.find_spec("bfcl_eval") is not None
needs_bfcl = pytest.mark.skipif(not HAVE_BFCL, reason="bfcl-eval is not installed")


@pytest.fixture(scope="module")
def bfcl() -> dict[str, Trace]:
    if not HAVE_BFCL:
        pytest.skip("bfcl-eval is not installed")
    return {t.id: t for t in T.load_bfcl("multi_turn_base")}


def test_bfcl_base_loads_all_and_is_valid(bfcl):
    assert len(bfcl) == 200
    for t in bfcl.values():
        assert t.source == "bfcl" and t.meta["category"] == "multi_turn_base"
        # ground truth passes ticket ids as strings where the doc says integer (BFCL data)
        check_trace(t, schema_exceptions=frozenset({"close_ticket"}))
        anns = annotate_messages(t.messages)
        assert current_turn(anns) == t.meta["num_turns"] - 1
        # every turn ends with a plain assistant message, so the next starts cleanly
        for i, m in enumerate(t.messages):
            if m["role"] == "user" and i > 0:
                assert t.messages[i - 1]["role"] == "assistant"
                assert not t.messages[i - 1].get("tool_calls")
        assert t.messages[-1]["role"] == "assistant" and isinstance(t.messages[-1]["content"], str)
        assert not any(r.startswith("Error during execution") for _, _, r in _calls(t))


def test_bfcl_tools_come_from_the_function_docs(bfcl):
    t = bfcl["multi_turn_base_0"]
    names = [x["function"]["name"] for x in t.tools]
    assert t.meta["involved_classes"] == ["TwitterAPI", "GorillaFileSystem"]
    assert len(names) == 14 + 18 and {"post_tweet", "mv", "grep", "diff"} <= set(names)
    mv = next(x["function"] for x in t.tools if x["function"]["name"] == "mv")
    assert mv["parameters"]["type"] == "object"
    assert mv["parameters"]["required"] == ["source", "destination"]
    assert mv["parameters"]["properties"]["source"]["type"] == "string"
    types = {
        p.get("type")
        for tr in bfcl.values()
        for x in tr.tools
        for p in x["function"]["parameters"]["properties"].values()
    }
    assert types <= {
        "string",
        "integer",
        "number",
        "boolean",
        "array",
        "object",
    }  # no "dict"/"float"


def test_bfcl_results_come_from_executing_the_simulators(bfcl):
    # base_2: touch + echo write a file; cp, cd, mv rename it; cat reads back what echo wrote
    calls = _calls(bfcl["multi_turn_base_2"])
    assert [n for n, _, _ in calls] == ["cd", "touch", "echo", "diff", "cp", "cd", "mv", "cat"]
    text = calls[2][1]["content"]
    assert json.loads(calls[-1][2]) == {"file_content": text}
    # base_1: log.txt is moved into archive/, and grep finds it there
    calls = _calls(bfcl["multi_turn_base_1"])
    assert json.loads(calls[0][2]) == {"current_directory_content": ["workspace"]}
    assert "moved to 'archive/log.txt'" in calls[2][2]
    assert "Error: Something went wrong." in json.loads(calls[4][2])["matching_lines"][0]
    # base_0: positional call sort('final_report.pdf') is bound to its parameter name
    sort = next(c for c in _calls(bfcl["multi_turn_base_0"]) if c[0] == "sort")
    assert sort[1] == {"file_name": "final_report.pdf"}
    assert "budget analysis" in json.loads(sort[2])["sorted_content"]


@needs_bfcl
def test_simulator_state_changes_between_calls(bfcl):
    entry = next(
        e
        for e in B._read_jsonl(B._data_file(B.bfcl_root() / "data", "multi_turn_base"))
        if e["id"] == "multi_turn_base_1"
    )
    sims = B.Simulators(entry["involved_classes"], entry["initial_config"], long_context=False)
    _, before = sims.call("ls", [], {"a": True})
    sims.call("cd", [], {"folder": "workspace"})
    _, inside = sims.call("ls", [], {})
    sims.call("mkdir", [], {"dir_name": "reports"})
    sims.call("mv", [], {"source": "log.txt", "destination": "reports"})
    _, after = sims.call("ls", [], {})
    assert json.loads(before)["current_directory_content"] == ["workspace"]
    assert sorted(json.loads(inside)["current_directory_content"]) == ["archive", "log.txt"]
    assert sorted(json.loads(after)["current_directory_content"]) == ["archive", "reports"]
    assert "Error during execution" in sims.call("nope", [], {})[1]
    assert "Error during execution" in sims.call("cd", [], {"wrong": 1})[1]


def test_bfcl_is_deterministic_and_sampled(bfcl):
    a = T.load_bfcl("multi_turn_base", limit=7, seed=3)
    b = T.load_bfcl("base", limit=7, seed=3)
    assert [t.messages for t in a] == [t.messages for t in b]
    assert [t.messages for t in a] == [bfcl[t.id].messages for t in a]
    ids = [t.id for t in a]
    assert ids == sorted(ids, key=lambda i: int(i.rsplit("_", 1)[1]))
    assert ids != [t.id for t in T.load_bfcl("base", limit=7, seed=4)]


@needs_bfcl
def test_bfcl_miss_func_and_miss_param():
    for t in T.load_bfcl("multi_turn_miss_func", limit=15):
        ((turn, names),) = t.meta["missed_function"].items()
        users = [m for m in t.messages if m["role"] == "user"]
        assert users[int(turn)]["content"] == B.ADDED_FUNCTIONS_PROMPT
        assert set(names) <= {x["function"]["name"] for x in t.tools}
        check_trace(t, schema_exceptions=frozenset({"close_ticket"}))
        assert any(m.get("content") == B.NO_CALL_REPLY for m in t.messages)
    for t in T.load_bfcl("multi_turn_miss_param", limit=10):
        check_trace(t, schema_exceptions=frozenset({"close_ticket"}))
        assert any(m.get("content") == B.NO_CALL_REPLY for m in t.messages)


@needs_bfcl
def test_bfcl_long_context_is_longer():
    long = T.load_bfcl("multi_turn_long_context", limit=10, seed=0)
    base = {t.id: t for t in T.load_bfcl("multi_turn_base", limit=10, seed=0)}
    for t in long:
        check_trace(t, schema_exceptions=frozenset({"close_ticket"}))

    def size(ts):
        return sum(len(m["content"] or "") for t in ts for m in t.messages if m["role"] == "tool")

    assert size(long) > 2 * size(base.values())


@needs_bfcl
def test_bfcl_missing_simulator_package_skips_those_classes(monkeypatch):
    real = B._simulator_class

    def fake(name):
        if name == "MathAPI":
            raise ModuleNotFoundError("No module named 'mpmath'", name="mpmath")
        return real(name)

    monkeypatch.setattr(B, "_simulator_class", fake)
    with pytest.warns(UserWarning, match="MathAPI needs the missing package 'mpmath'"):
        traces = T.load_bfcl("multi_turn_base")
    assert 150 <= len(traces) < 200
    assert all("MathAPI" not in t.meta["involved_classes"] for t in traces)


@needs_bfcl
def test_bfcl_bad_category():
    with pytest.raises(ValueError, match="unknown BFCL category 'multi_turn_nope'"):
        T.load_bfcl("nope")


@pytest.mark.parametrize(
    "text, want",
    [
        ("cd(folder='document')", ("cd", [], {"folder": "document"})),
        ("sort('final_report.pdf')", ("sort", ["final_report.pdf"], {})),
        (
            "lockDoors(unlock=False, door=['driver', 'passenger'])",
            ("lockDoors", [], {"unlock": False, "door": ["driver", "passenger"]}),
        ),
        (
            "f(x=-1.5, y={'a': (1, 2)}, z=None)",
            ("f", [], {"x": -1.5, "y": {"a": (1, 2)}, "z": None}),
        ),
    ],
)
def test_parse_call(text, want):
    assert B.parse_call(text) == want


@pytest.mark.parametrize(
    "text",
    [
        "cd(folder=__import__('os').getcwd())",
        "os.system('ls')",
        "cd",
        "cd(folder=x)",
        "cd(**{'folder': 'a'})",
        "cd(folder='a'",
        "(lambda: 1)()",
    ],
)
def test_parse_call_rejects_non_literal_code(text):
    with pytest.raises(ValueError):
        B.parse_call(text)


# ----------------------------------------------------------------- JSONL


def test_jsonl_round_trip(tmp_path, tau, bfcl):
    path = tmp_path / "mine.jsonl"
    picked = tau[:3] + list(bfcl.values())[:2]
    path.write_text("\n".join(t.to_json() for t in picked) + "\n\n")
    back = load_jsonl(path)
    assert back == picked
    # minimal lines: default ids and source
    path.write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": [{"role": "user", "content": "yo"}], "tools": null}\n'
    )
    a, b = load_jsonl(path)
    assert (a.id, a.source, a.tools) == ("mine:1", "jsonl", None)
    assert b.id == "mine:3"


GOOD = '{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    "bad, pattern",
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"tools": []}', "'messages' must be a non-empty list"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": "hi"}', "'messages' must be a non-empty list"),
        ('{"messages": [5]}', r"messages\[0\] must be an object"),
        ('{"messages": [{"content": "x"}]}', "message 0: message has no 'role'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "x"}]}',
            "message 1: unknown role 'bot'",
        ),
        (
            '{"messages": [{"role": "user", "content": [7]}]}',
            "message 0: content block must be a dict or str",
        ),
        ('{"messages": [{"role": "user", "content": "x"}], "tools": {}}', "'tools' must be a list"),
        (
            '{"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]}',
            r"tools\[0\]: expected",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}], "extra": 1}',
            r"unknown keys \['extra'\]",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}], "id": ""}',
            "'id' must be a non-empty string",
        ),
        (
            '{"messages": [{"role": "user", "content": "x"}], "id": "mine:1"}',
            "duplicate id 'mine:1' \\(first on line 1\\)",
        ),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, bad, pattern):
    path = tmp_path / "mine.jsonl"
    path.write_text(f"{GOOD}\n\n{bad}\n{GOOD}\n")
    with pytest.raises(TraceFormatError, match=pattern) as ei:
        load_jsonl(path)
    assert ei.value.line == 3
    assert str(ei.value).startswith(f"{path}:3: ")


# ----------------------------------------------------------------- dispatch and sampling


@needs_bfcl
def test_load_source(tmp_path, tau):
    assert [t.id for t in load_source("tau-bench", limit=5, seed=2)] == [
        t.id for t in load_tau_bench(limit=5, seed=2)
    ]
    assert [t.id for t in load_source("bfcl", limit=3)] == [t.id for t in T.load_bfcl(limit=3)]
    assert {t.meta["category"] for t in load_source("bfcl:miss_param", limit=2)} == {
        "multi_turn_miss_param"
    }
    path = tmp_path / "u.jsonl"
    path.write_text("\n".join(t.to_json() for t in tau[:6]))
    assert len(load_source(str(path), limit=4)) == 4
    with pytest.raises(ValueError, match="unknown trace source 'sharegpt'"):
        load_source("sharegpt")


def test_sample_order_and_bounds():
    ts = [Trace(f"x_{i}", "s", []) for i in (10, 2, 1, 33)]
    assert [t.id for t in sample(ts)] == ["x_1", "x_2", "x_10", "x_33"]
    assert sample(ts, 0) == []
    assert len(sample(ts, 2, seed=5)) == 2
    assert sample(ts, 2, seed=5) == sample(list(reversed(ts)), 2, seed=5)  # input order irrelevant
    with pytest.raises(ValueError, match="limit must be >= 0"):
        sample(ts, -1)


def test_sample_is_nested_across_limits():
    """--limit 2 in CI replays a subset of --limit 50: results of different runs merge."""
    ts = [Trace(f"x_{i}", "s", []) for i in range(200)]
    picks = [{t.id for t in sample(ts, k, seed=0)} for k in (1, 2, 15, 50, 120, 199)]
    assert [len(p) for p in picks] == [1, 2, 15, 50, 120, 199]
    assert all(small < large for small, large in zip(picks[:-1], picks[1:], strict=True))
    assert picks[3] != {t.id for t in sample(ts, 50, seed=1)}


def test_check_tool_calls_catches_mismatches():
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    check_tool_calls(
        [
            {"role": "user", "content": "u"},
            call,
            {"role": "tool", "tool_call_id": "a", "content": "r"},
        ]
    )
    with pytest.raises(ValueError, match="tool_call_id 'b' answers no open call"):
        check_tool_calls([call, {"role": "tool", "tool_call_id": "b", "content": "r"}])
    with pytest.raises(ValueError, match="never answered"):
        check_tool_calls([call, {"role": "user", "content": "u"}])
    with pytest.raises(ValueError, match="never answered"):
        check_tool_calls([call])


@needs_bfcl
def test_loaders_do_not_import_torch():
    code = (
        "import sys\n"
        "from agentkv.bench.traces import load_source\n"
        "load_source('bfcl', limit=5); load_source('bfcl:long_context', limit=2)\n"
        "try:\n"
        "    load_source('tau-bench', limit=2)\n"
        "except FileNotFoundError:\n"
        "    pass\n"
        "bad = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ)
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, env=env, cwd=Path(__file__).parent
    )
