"""Policy models: defaults, range errors (message text), unknown fields, parsing, graph
policies, immutability."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from agentkv.policies import (
    ARKV,
    H2O,
    MAX_BUDGET,
    POLICY_CLASSES,
    FullCache,
    GraphPolicy,
    IntentKV,
    KVPolicy,
    KVzap,
    SnapKV,
    StreamingLLM,
    TriAxialKV,
    UniformQuant,
    UnknownNodeError,
    parse_policy,
    parse_policy_spec,
)

ALL = [FullCache, IntentKV, TriAxialKV, KVzap, ARKV, StreamingLLM, SnapKV, H2O, UniformQuant]
METHODS = {
    FullCache: "full",
    IntentKV: "intentkv",
    TriAxialKV: "triaxialkv",
    KVzap: "kvzap",
    ARKV: "arkv",
    StreamingLLM: "streamingllm",
    SnapKV: "snapkv",
    H2O: "h2o",
    UniformQuant: "uniform_quant",
}


def test_registry_is_complete():
    assert {m: c for c, m in METHODS.items()} == POLICY_CLASSES


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_defaults_are_valid_and_round_trip(cls):
    p = cls()
    assert p.method == METHODS[cls]
    again = cls.model_validate(p.model_dump())
    assert again == p
    assert parse_policy(p.model_dump()) == p
    assert parse_policy(json.loads(p.model_dump_json())) == p
    assert type(parse_policy({"method": METHODS[cls]})) is cls
    assert p.describe().startswith(f"{METHODS[cls]}(")


@pytest.mark.parametrize(
    "cls, evicts, quantizes",
    [
        (FullCache, False, False),
        (IntentKV, True, False),
        (TriAxialKV, False, True),
        (KVzap, True, False),
        (ARKV, True, True),
        (StreamingLLM, True, False),
        (SnapKV, True, False),
        (H2O, True, False),
        (UniformQuant, False, True),
    ],
)
def test_capability_flags(cls, evicts, quantizes):
    assert (cls.evicts, cls.quantizes) == (evicts, quantizes)


RANGE_CASES = [
    (IntentKV, "budget", 0, "budget: must be in [1, 1048576], got 0"),
    (IntentKV, "budget", MAX_BUDGET + 1, "budget: must be in [1, 1048576], got 1048577"),
    (IntentKV, "budget", -5, "budget: must be in [1, 1048576], got -5"),
    (IntentKV, "memory_decay", 1.0, "memory_decay: must be in [0, 1), got 1.0"),
    (IntentKV, "memory_decay", -0.1, "memory_decay: must be in [0, 1), got -0.1"),
    (IntentKV, "memory_decay", float("nan"), "memory_decay: must be in [0, 1), got nan"),
    (IntentKV, "alpha_max", 100.5, "alpha_max: must be in [0, 100], got 100.5"),
    (IntentKV, "fallback_window", 0, "fallback_window: must be in [1, 4096], got 0"),
    (TriAxialKV, "avg_bits", 1.5, "avg_bits: must be in [2, 4], got 1.5"),
    (TriAxialKV, "avg_bits", 8, "avg_bits: must be in [2, 4], got 8"),
    (KVzap, "threshold", -21, "threshold: must be in [-20, 5], got -21"),
    (KVzap, "threshold", 5.5, "threshold: must be in [-20, 5], got 5.5"),
    (KVzap, "window", -1, "window: must be in [0, 1048576], got -1"),
    (ARKV, "budget", 0, "budget: must be in [1, 1048576], got 0"),
    (ARKV, "window", 0, "window: must be in [1, 4096], got 0"),
    (ARKV, "window", 4097, "window: must be in [1, 4096], got 4097"),
    (ARKV, "tau1", 0, "tau1: must be in (0, 1000], got 0"),
    (ARKV, "tau2", -1.0, "tau2: must be in (0, 1000], got -1.0"),
    (ARKV, "tau3", 1001, "tau3: must be in (0, 1000], got 1001"),
    (ARKV, "gamma", -0.5, "gamma: must be in [0, 1000000], got -0.5"),
    (ARKV, "gamma", float("inf"), "gamma: must be in [0, 1000000], got inf"),
    (StreamingLLM, "budget", 0, "budget: must be in [1, 1048576], got 0"),
    (StreamingLLM, "sinks", -1, "sinks: must be in [0, 4096], got -1"),
    (SnapKV, "window", 0, "window: must be in [1, 4096], got 0"),
    (SnapKV, "kernel", 0, "kernel: must be in [1, 63], got 0"),
    (SnapKV, "kernel", 65, "kernel: must be in [1, 63], got 65"),
    (SnapKV, "budget", 2_000_000, "budget: must be in [1, 1048576], got 2000000"),
    (H2O, "budget", 0, "budget: must be in [1, 1048576], got 0"),
    (H2O, "recent", -1, "recent: must be in [0, 1048576], got -1"),
]


@pytest.mark.parametrize("cls, field, value, message", RANGE_CASES, ids=lambda x: str(x))
def test_out_of_range_names_field_and_range(cls, field, value, message):
    with pytest.raises(ValidationError) as ei:
        cls(**{field: value})
    (err,) = ei.value.errors()
    assert err["loc"] == (field,)
    assert err["type"] == "out_of_range"
    assert err["msg"] == message
    assert message in str(ei.value)
    # the same message through the discriminated union (wire / parse_policy)
    with pytest.raises(ValidationError) as ei2:
        parse_policy({"method": METHODS[cls], field: value})
    assert ei2.value.errors()[0]["msg"] == message


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (IntentKV, "budget", 1),
        (IntentKV, "budget", MAX_BUDGET),
        (IntentKV, "memory_decay", 0.0),
        (IntentKV, "memory_decay", 0.999),
        (ARKV, "tau1", 1000),
        (KVzap, "threshold", -20),
        (KVzap, "window", 0),
        (TriAxialKV, "avg_bits", 2),
        (SnapKV, "kernel", 63),
        (H2O, "recent", 0),
    ],
)
def test_boundaries_are_accepted(cls, field, value):
    assert getattr(cls(**{field: value}), field) == value


@pytest.mark.parametrize(
    "cls, kwargs, pattern",
    [
        (StreamingLLM, {"budget": 8, "sinks": 8}, r"sinks: must be < budget \(8\), got 8"),
        (StreamingLLM, {"sinks": 2000}, r"sinks: must be < budget \(1024\), got 2000"),
        (SnapKV, {"kernel": 4}, r"kernel: must be odd, got 4"),
        (IntentKV, {"mode": "random"}, r"mode\n.*Input should be 'memory', 'query' or 'learned'"),
        (
            IntentKV,
            {"budget_scope": "all"},
            r"budget_scope\n.*Input should be 'total' or 'history'",
        ),
        (TriAxialKV, {"group_size": 64}, r"group_size\n.*Input should be 32"),
        (
            TriAxialKV,
            {"allocation": {"obs/text/older": 3}},
            r"allocation\.obs/text/older\n.*Input should be 2 or 4",
        ),
        (ARKV, {"quant_bits": 8}, r"quant_bits\n.*Input should be 2 or 4"),
        (UniformQuant, {"bits": 3}, r"bits\n.*Input should be 2 or 4"),
        (KVzap, {"surrogate": "tree"}, r"surrogate\n.*Input should be 'mlp' or 'linear'"),
        (IntentKV, {"budget": "lots"}, r"budget\n.*Input should be a valid integer"),
        (IntentKV, {"budget": 1.5}, r"budget\n.*valid integer"),
        (IntentKV, {"budget": "512"}, r"budget\n.*valid integer"),  # strict: no coercion
        (IntentKV, {"protect_system": "yes"}, r"protect_system\n.*valid boolean"),
        (IntentKV, {"method": "arkv"}, r"method\n.*Input should be 'intentkv'"),
    ],
)
def test_other_invalid_values(cls, kwargs, pattern):
    with pytest.raises(ValidationError, match=pattern):
        cls(**kwargs)


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_unknown_fields_are_rejected(cls):
    with pytest.raises(ValidationError) as ei:
        cls(budgett=5)
    (err,) = ei.value.errors()
    assert err["loc"] == ("budgett",) and err["type"] == "extra_forbidden"
    with pytest.raises(ValidationError, match="budgett"):
        parse_policy({"method": METHODS[cls], "budgett": 5})


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_frozen(cls):
    p = cls()
    with pytest.raises(ValidationError, match="frozen"):
        p.method = "other"
    name = next((f for f in type(p).model_fields if f != "method"), None)
    if name:
        with pytest.raises(ValidationError, match="frozen"):
            setattr(p, name, getattr(p, name))
    assert hash(p) == hash(cls())  # frozen models hash by value
    assert p == cls()


def test_graph_policy_is_frozen():
    g = GraphPolicy(default=IntentKV(), nodes={"tools": H2O()})
    with pytest.raises(ValidationError, match="frozen"):
        g.default = FullCache()


def test_graph_policy_nodes_cannot_be_mutated():
    g = GraphPolicy(nodes={"tools": H2O()})
    with pytest.raises(TypeError):
        g.nodes["agent"] = IntentKV()
    t = TriAxialKV(allocation={"obs/text/older": 2})
    with pytest.raises(TypeError):
        t.allocation["user/text/current"] = 4
    # still plain dicts on the wire, and round-trips
    assert GraphPolicy.model_validate(g.model_dump()) == g
    assert isinstance(g.model_dump()["nodes"], dict)
    assert TriAxialKV.model_validate_json(t.model_dump_json()) == t


def test_describe():
    assert IntentKV(budget=512).describe() == "intentkv(budget=512)"
    assert (
        IntentKV(budget=512, memory_decay=0.7).describe()
        == "intentkv(budget=512, memory_decay=0.7)"
    )
    assert FullCache().describe() == "full()"
    assert UniformQuant(bits=2).describe() == "uniform_quant(bits=2)"


# ----------------------------------------------------------------- parse_policy / specs


def test_parse_policy():
    p = parse_policy({"method": "intentkv", "budget": 512})
    assert p == IntentKV(budget=512)
    # a payload of a client that predates budget_scope gets the paper's (total) reading
    assert p.budget_scope == "total" and p.fallback_window == 32
    old = parse_policy({"method": "intentkv", "budget": 512, "budget_scope": "history"})
    assert old.describe() == "intentkv(budget=512, budget_scope=history)"
    assert parse_policy(p) is p
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        parse_policy({"method": "lru"})
    with pytest.raises(ValidationError, match="Unable to extract tag using discriminator 'method'"):
        parse_policy({"budget": 5})
    assert parse_policy("intentkv") == IntentKV()  # spec strings wherever a policy is
    with pytest.raises(ValidationError):
        parse_policy(["intentkv"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec, want",
    [
        ("full", FullCache()),
        ("intentkv", IntentKV()),
        ("intentkv:budget=512", IntentKV(budget=512)),
        (" IntentKV : budget = 512 , memory_decay=0.7 ", IntentKV(budget=512, memory_decay=0.7)),
        ("intentkv:protect_system=false,mode=query", IntentKV(protect_system=False, mode="query")),
        ("streamingllm:budget=64,sinks=4", StreamingLLM(budget=64, sinks=4)),
        (
            "kvzap:threshold=-6.5,window=0,surrogate=linear",
            KVzap(threshold=-6.5, window=0, surrogate="linear"),
        ),
        ("arkv:quant_bits=2,tau1=3", ARKV(quant_bits=2, tau1=3)),
        ("uniform_quant:bits=2", UniformQuant(bits=2)),
        ("snapkv:kernel=7,", SnapKV(kernel=7)),
    ],
)
def test_parse_policy_spec(spec, want):
    assert parse_policy_spec(spec) == want


@pytest.mark.parametrize(
    "spec, exc, pattern",
    [
        ("lru:budget=5", ValueError, "unknown policy 'lru'; expected one of"),
        ("", ValueError, "unknown policy ''"),
        (
            "intentkv:budget",
            ValueError,
            "policy spec 'intentkv:budget': expected key=value, got 'budget'",
        ),
        ("intentkv:budget=0", ValidationError, re.escape("budget: must be in [1, 1048576], got 0")),
        (
            "intentkv:memory_decay=1",
            ValidationError,
            re.escape("memory_decay: must be in [0, 1), got 1"),
        ),
        ("intentkv:bogus=1", ValidationError, "bogus\n.*Extra inputs are not permitted"),
        ("snapkv:kernel=8", ValidationError, "kernel: must be odd, got 8"),
    ],
)
def test_parse_policy_spec_errors(spec, exc, pattern):
    with pytest.raises(exc, match=pattern):
        parse_policy_spec(spec)


# ----------------------------------------------------------------- graph policies


def test_graph_policy_for_node_and_defaults():
    g = GraphPolicy()
    assert g.default == FullCache() and g.nodes == {}
    g = GraphPolicy(
        default={"method": "intentkv", "budget": 256},
        nodes={"tools": {"method": "h2o", "budget": 64}, "writer": TriAxialKV(avg_bits=2.5)},
    )
    assert g.for_node("tools") == H2O(budget=64)
    assert g.for_node("writer") == TriAxialKV(avg_bits=2.5)
    assert g.for_node("planner") == IntentKV(budget=256)
    assert g.for_node(None) == IntentKV(budget=256)
    assert GraphPolicy.model_validate_json(g.model_dump_json()) == g


def test_graph_policy_node_errors_carry_the_path():
    with pytest.raises(ValidationError) as ei:
        GraphPolicy(nodes={"a": {"method": "arkv", "tau1": 0}})
    (err,) = ei.value.errors()
    assert err["loc"][:2] == ("nodes", "a") and err["loc"][-1] == "tau1"
    assert err["msg"] == "tau1: must be in (0, 1000], got 0"
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        GraphPolicy(defaults=IntentKV())


def test_check_nodes():
    g = GraphPolicy(nodes={"agent": IntentKV(), "tool": H2O(), "toolz": SnapKV()})
    g.check_nodes(["agent", "tool", "toolz", "extra"])
    with pytest.raises(UnknownNodeError) as ei:
        g.check_nodes(["agent", "tools"])
    msg = str(ei.value)
    assert (
        "policy overrides name nodes that do not exist in the graph: 'tool' (did you mean "
        "'tools'?), 'toolz' (did you mean 'tools'?)" in msg
    )
    assert "nodes are: ['agent', 'tools']" in msg
    with pytest.raises(UnknownNodeError, match=r"'zzz'; nodes are"):  # nothing close: no hint
        GraphPolicy(nodes={"zzz": H2O()}).check_nodes(["agent"])
    assert isinstance(ei.value, ValueError)
    GraphPolicy().check_nodes([])  # no overrides: nothing to check


def test_base_policy_class_is_not_a_wire_policy():
    with pytest.raises(ValidationError):
        GraphPolicy(default=KVPolicy(method="custom"))


def test_positional_arguments_fill_fields_in_order():
    assert IntentKV(512) == IntentKV(budget=512)
    assert StreamingLLM(64, 2) == StreamingLLM(budget=64, sinks=2)
    assert UniformQuant(2) == UniformQuant(bits=2)
    assert TriAxialKV(2.5) == TriAxialKV(avg_bits=2.5)
    with pytest.raises(ValidationError, match=r"budget: must be in \[1, 1048576\], got 0"):
        IntentKV(0)
    with pytest.raises(TypeError, match="multiple values for 'budget'"):
        H2O(32, budget=64)
    with pytest.raises(TypeError, match=r"FullCache\(\) takes at most 0 positional"):
        FullCache(1)


def test_spec_strings_wherever_a_policy_is():
    g = GraphPolicy(default="intentkv:budget=256", nodes={"tools": "h2o:budget=32"})
    assert g == GraphPolicy(default=IntentKV(budget=256), nodes={"tools": H2O(budget=32)})
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        GraphPolicy(nodes={"tools": "nope"})
    assert parse_policy("h2o:budget=32") == H2O(budget=32)
    with pytest.raises(ValueError, match=r"unknown policy 'h20' \(did you mean 'h2o'\?\)"):
        parse_policy("h20:budget=32")


def test_graph_policy_merge():
    base = GraphPolicy(default=IntentKV(), nodes={"a": H2O(), "b": SnapKV()})
    over = GraphPolicy.model_validate({"nodes": {"b": "full", "c": "h2o:budget=8"}})
    assert base.merged(over) == GraphPolicy(
        default=IntentKV(), nodes={"a": H2O(), "b": FullCache(), "c": H2O(budget=8)}
    )
    assert base.merged(GraphPolicy(default=FullCache())).default == FullCache()
