"""Wire protocol v1: round trips on real trajectories, malformed payloads, JSON Schema."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv.annotation import annotate_messages
from agentkv.policies import (
    ARKV,
    H2O,
    FullCache,
    IntentKV,
    KVzap,
    SnapKV,
    StreamingLLM,
    TriAxialKV,
    UniformQuant,
)
from agentkv.session import resolve_session_id
from agentkv.wire import (
    CUSTOM_PARAMS,
    PROTOCOL_VERSION,
    WIRE_KEY,
    KVPayload,
    PayloadError,
    build_payload,
    decode_payload,
    encode_payload,
    json_schema,
    payload_from_request,
    to_extra_body,
)

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "docs" / "wire-protocol-v1.schema.json"

POLICIES = [
    FullCache(),
    IntentKV(budget=512, memory_decay=0.7, mode="query"),
    TriAxialKV(avg_bits=2.5, allocation={"obs/text/older": 2, "user/text/current": 4}),
    KVzap(threshold=-6.0, window=64),
    ARKV(budget=256, quant_bits=2),
    StreamingLLM(budget=128, sinks=4),
    SnapKV(kernel=7),
    H2O(recent=16),
    UniformQuant(bits=2),
]


def _payload(traj, policy=None, node="agent") -> KVPayload:
    return build_payload(traj, policy or IntentKV(), resolve_session_id(messages=traj), node=node)


@pytest.fixture(scope="module")
def base(tau_trajs) -> dict:
    """A valid payload dict built from a real trajectory prefix (system, user, assistant +
    tool call, tool result)."""
    traj = tau_trajs[0]
    cut = next(i for i, m in enumerate(traj) if m["role"] == "tool") + 1
    return json.loads(encode_payload(_payload(traj[:cut])))


# ----------------------------------------------------------------- round trips


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.method)
def test_round_trip_every_policy(tau_trajs, policy):
    p = _payload(tau_trajs[1], policy)
    raw = encode_payload(p)
    assert isinstance(raw, str)
    back = decode_payload(raw)
    assert back == p
    assert type(back.policy) is type(policy)
    assert decode_payload(raw.encode()) == p
    assert decode_payload(json.loads(raw)) == p


def test_round_trip_real_trajectories(tau_trajs):
    for traj in tau_trajs[::8]:
        for end in (2, len(traj) // 2, len(traj)):
            p = _payload(traj[:end])
            back = decode_payload(encode_payload(p))
            assert back == p
            assert back.messages == annotate_messages(traj[:end], node="agent")
            assert back.version == PROTOCOL_VERSION == 1


def test_encoded_payload_shape(base):
    assert base["version"] == 1
    assert base["session_id"].startswith("task:")
    assert base["policy"] == {
        "method": "intentkv",
        "budget": 2048,
        "budget_scope": "total",
        "memory_decay": 0.5,
        "mode": "memory",
        "protect_system": True,
        "fallback_window": 32,
        "alpha_max": None,
        "ablate": None,
    }
    roles = [m["role"] for m in base["messages"]]
    assert roles[0] == "system" and roles[-1] == "tool"
    assert base["messages"][0]["semantic"] == "inst"
    assert base["messages"][-1]["semantic"] == "obs" and base["messages"][-1]["actionable"] is True
    assert {p["modality"] for m in base["messages"] for p in m["parts"]} == {"text"}


def test_payload_without_messages_or_node():
    p = KVPayload(session_id="s")
    assert p.policy == FullCache() and p.messages is None and p.node is None
    assert decode_payload(encode_payload(p)) == p
    assert decode_payload({"version": 1, "session_id": "s"}) == p


def test_to_extra_body_merges(tau_trajs):
    p = _payload(tau_trajs[2][:3])
    existing = {"custom_params": {"other": "x"}, "temperature": 0.2}
    snapshot = copy.deepcopy(existing)
    body = to_extra_body(p, existing)
    assert existing == snapshot  # caller's dict untouched
    assert body["temperature"] == 0.2
    assert body[CUSTOM_PARAMS]["other"] == "x"
    assert isinstance(body[CUSTOM_PARAMS][WIRE_KEY], str)
    assert payload_from_request(body) == p
    assert to_extra_body(p) == {CUSTOM_PARAMS: {WIRE_KEY: encode_payload(p)}}
    assert to_extra_body(p, {"custom_params": None})[CUSTOM_PARAMS] == {WIRE_KEY: encode_payload(p)}
    # replacing an older payload
    again = to_extra_body(KVPayload(session_id="new"), body)
    assert payload_from_request(again).session_id == "new"
    assert again[CUSTOM_PARAMS]["other"] == "x"


def test_payload_from_request():
    assert payload_from_request({"model": "m", "messages": []}) is None
    assert payload_from_request({"custom_params": {}}) is None
    assert payload_from_request({"custom_params": {"other": 1}}) is None
    assert payload_from_request(
        {"custom_params": {"agentkv": {"version": 1, "session_id": "s"}}}
    ) == KVPayload(session_id="s")
    with pytest.raises(PayloadError) as ei:
        payload_from_request({"custom_params": "agentkv"})
    assert ei.value.field == "custom_params"
    with pytest.raises(PayloadError, match="must be a JSON object, got int"):
        payload_from_request({"custom_params": {"agentkv": 5}})
    with pytest.raises(PayloadError, match="not valid JSON"):
        payload_from_request({"custom_params": {"agentkv": "{oops"}})


# ----------------------------------------------------------------- malformed payloads


def _mut(base: dict, path: tuple, value=..., delete=False) -> dict:
    d = copy.deepcopy(base)
    cur = d
    for p in path[:-1]:
        cur = cur[p]
    if delete:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return d


def _with(base: dict, **top) -> dict:
    d = copy.deepcopy(base)
    d.update(top)
    return d


# (id, builder(base) -> raw, field, message fragment)
MALFORMED = [
    # not JSON / not an object
    ("empty-string", lambda b: "", None, "not valid JSON"),
    ("truncated", lambda b: json.dumps(b)[:-1], None, "not valid JSON"),
    ("single-quotes", lambda b: "{'version': 1}", None, "not valid JSON"),
    ("trailing-comma", lambda b: '{"version": 1,}', None, "not valid JSON"),
    ("bad-utf8", lambda b: b"\x80\x81\x82", None, "not valid JSON"),
    ("deep-nesting", lambda b: "[" * 100_000, None, "not valid JSON"),
    ("json-list", lambda b: "[]", None, "must be a JSON object, got list"),
    ("json-number", lambda b: "1", None, "must be a JSON object, got int"),
    ("json-string", lambda b: '"agentkv"', None, "must be a JSON object, got str"),
    ("json-null", lambda b: "null", None, "must be a JSON object, got NoneType"),
    ("json-true", lambda b: "true", None, "must be a JSON object, got bool"),
    ("python-list", lambda b: [b], None, "must be a JSON object, got list"),
    ("python-int", lambda b: 7, None, "must be a JSON object, got int"),
    # version
    (
        "no-version",
        lambda b: _mut(b, ("version",), delete=True),
        "version",
        "unsupported agentkv protocol version None",
    ),
    (
        "version-2",
        lambda b: _with(b, version=2),
        "version",
        "version 2; this engine speaks version 1",
    ),
    ("version-0", lambda b: _with(b, version=0), "version", "version 0"),
    ("version-str", lambda b: _with(b, version="1"), "version", "version '1'"),
    ("version-true", lambda b: _with(b, version=True), "version", "version True"),
    ("version-float", lambda b: _with(b, version=1.0), "version", "version 1.0"),
    ("version-null", lambda b: _with(b, version=None), "version", "version None"),
    ("version-list", lambda b: _with(b, version=[1]), "version", "version [1]"),
    # top-level fields
    ("no-session", lambda b: _mut(b, ("session_id",), delete=True), "session_id", "Field required"),
    ("empty-session", lambda b: _with(b, session_id=""), "session_id", "at least 1 character"),
    (
        "long-session",
        lambda b: _with(b, session_id="s" * 513),
        "session_id",
        "at most 512 characters",
    ),
    ("int-session", lambda b: _with(b, session_id=5), "session_id", "valid string"),
    ("null-session", lambda b: _with(b, session_id=None), "session_id", "valid string"),
    (
        "unknown-top",
        lambda b: _with(b, sessionid="s"),
        "sessionid",
        "Extra inputs are not permitted",
    ),
    (
        "unknown-top-2",
        lambda b: _with(b, tokens=[1, 2]),
        "tokens",
        "Extra inputs are not permitted",
    ),
    ("int-node", lambda b: _with(b, node=5), "node", "valid string"),
    ("list-node", lambda b: _with(b, node=["a"]), "node", "valid string"),
    # policy
    ("policy-str", lambda b: _with(b, policy="intentkv"), "policy", "valid dictionary or object"),
    ("policy-null", lambda b: _with(b, policy=None), "policy", "valid dictionary or object"),
    (
        "policy-no-method",
        lambda b: _with(b, policy={"budget": 5}),
        "policy",
        "Unable to extract tag",
    ),
    ("policy-unknown", lambda b: _with(b, policy={"method": "lru"}), "policy", "Input tag 'lru'"),
    ("policy-method-int", lambda b: _with(b, policy={"method": 5}), "policy", "Input tag '5'"),
    (
        "budget-0",
        lambda b: _mut(b, ("policy", "budget"), 0),
        "policy.budget",
        "budget: must be in [1, 1048576], got 0",
    ),
    (
        "budget-huge",
        lambda b: _mut(b, ("policy", "budget"), 1 << 30),
        "policy.budget",
        "budget: must be in [1, 1048576], got 1073741824",
    ),
    (
        "budget-str",
        lambda b: _mut(b, ("policy", "budget"), "many"),
        "policy.budget",
        "valid integer",
    ),
    (
        "budget-frac",
        lambda b: _mut(b, ("policy", "budget"), 1.5),
        "policy.budget",
        "valid integer",
    ),
    (
        "budget-string",  # the wire is strict: no "512" -> 512 coercion
        lambda b: _mut(b, ("policy", "budget"), "512"),
        "policy.budget",
        "valid integer",
    ),
    (
        "decay-1",
        lambda b: _mut(b, ("policy", "memory_decay"), 1),
        "policy.memory_decay",
        "memory_decay: must be in [0, 1), got 1",
    ),
    (
        "mode-bad",
        lambda b: _mut(b, ("policy", "mode"), "both"),
        "policy.mode",
        "'memory', 'query' or 'learned'",
    ),
    (
        "policy-extra",
        lambda b: _mut(b, ("policy", "bogus"), 1),
        "policy.bogus",
        "Extra inputs are not permitted",
    ),
    (
        "policy-extra-named-like-method",
        lambda b: _mut(b, ("policy", "intentkv"), 1),
        "policy.intentkv",
        "Extra inputs",
    ),
    (
        "sinks-vs-budget",
        lambda b: _with(b, policy={"method": "streamingllm", "budget": 8, "sinks": 8}),
        "policy",
        "sinks: must be < budget (8), got 8",
    ),
    (
        "kernel-even",
        lambda b: _with(b, policy={"method": "snapkv", "kernel": 4}),
        "policy.kernel",
        "kernel: must be odd, got 4",
    ),
    (
        "alloc-bits",
        lambda b: _with(b, policy={"method": "triaxialkv", "allocation": {"obs/text/older": 3}}),
        "policy.allocation.obs/text/older",
        "2 or 4",
    ),
    (
        "avg-bits",
        lambda b: _with(b, policy={"method": "triaxialkv", "avg_bits": 5}),
        "policy.avg_bits",
        "avg_bits: must be in [2, 4], got 5",
    ),
    (
        "uq-bits",
        lambda b: _with(b, policy={"method": "uniform_quant", "bits": 8}),
        "policy.bits",
        "2 or 4",
    ),
    (
        "arkv-tau",
        lambda b: _with(b, policy={"method": "arkv", "tau1": 0}),
        "policy.tau1",
        "tau1: must be in (0, 1000], got 0",
    ),
    (
        "kvzap-threshold",
        lambda b: _with(b, policy={"method": "kvzap", "threshold": 100}),
        "policy.threshold",
        "threshold: must be in [-20, 5], got 100",
    ),
    (
        "h2o-recent",
        lambda b: _with(b, policy={"method": "h2o", "recent": -1}),
        "policy.recent",
        "recent: must be in [0, 1048576], got -1",
    ),
    # messages
    ("messages-str", lambda b: _with(b, messages="x"), "messages", "valid list"),
    ("messages-obj", lambda b: _with(b, messages={}), "messages", "valid list"),
    ("message-int", lambda b: _mut(b, ("messages", 0), 5), "messages.0", "valid dictionary"),
    (
        "message-no-index",
        lambda b: _mut(b, ("messages", 0, "index"), delete=True),
        "messages.0.index",
        "Field required",
    ),
    (
        "message-neg-index",
        lambda b: _mut(b, ("messages", 0, "index"), -1),
        "messages.0.index",
        "greater than or equal to 0",
    ),
    (
        "message-index-order",
        lambda b: _mut(b, ("messages", 1, "index"), 5),
        "messages",
        "messages[1].index is 5; expected 1",
    ),
    (
        "message-role",
        lambda b: _mut(b, ("messages", 0, "role"), "robot"),
        "messages.0.role",
        "'system', 'developer', 'user'",
    ),
    (
        "message-turn",
        lambda b: _mut(b, ("messages", 0, "turn"), -1),
        "messages.0.turn",
        "greater than or equal to 0",
    ),
    (
        "message-no-turn",
        lambda b: _mut(b, ("messages", 2, "turn"), delete=True),
        "messages.2.turn",
        "Field required",
    ),
    (
        "message-semantic",
        lambda b: _mut(b, ("messages", 0, "semantic"), "boss"),
        "messages.0.semantic",
        "unknown role 'boss'",
    ),
    (
        "message-semantic-int",
        lambda b: _mut(b, ("messages", 0, "semantic"), 0),
        "messages.0.semantic",
        "role must be a name string",
    ),
    (
        "message-actionable",
        lambda b: _mut(b, ("messages", 1, "actionable"), "maybe"),
        "messages.1.actionable",
        "valid boolean",
    ),
    (
        "message-extra",
        lambda b: _mut(b, ("messages", 0, "tokens"), 12),
        "messages.0.tokens",
        "Extra inputs are not permitted",
    ),
    (
        "message-name",
        lambda b: _mut(b, ("messages", 0, "name"), 5),
        "messages.0.name",
        "valid string",
    ),
    (
        "parts-str",
        lambda b: _mut(b, ("messages", 0, "parts"), "text"),
        "messages.0.parts",
        "valid list",
    ),
    (
        "part-modality",
        lambda b: _mut(b, ("messages", 1, "parts", 0, "modality"), "video"),
        "messages.1.parts.0.modality",
        "unknown modality 'video'",
    ),
    (
        "part-chars",
        lambda b: _mut(b, ("messages", 1, "parts", 0, "chars"), -3),
        "messages.1.parts.0.chars",
        "greater than or equal to 0",
    ),
    (
        "part-extra",
        lambda b: _mut(b, ("messages", 1, "parts", 0, "tokens"), 3),
        "messages.1.parts.0.tokens",
        "Extra inputs",
    ),
    (
        "part-no-semantic",
        lambda b: _mut(b, ("messages", 1, "parts", 0, "semantic"), delete=True),
        "messages.1.parts.0.semantic",
        "Field required",
    ),
    (
        "part-semantic",
        lambda b: _mut(b, ("messages", 1, "parts", 0, "semantic"), "thought"),
        "messages.1.parts.0.semantic",
        "unknown role 'thought'",
    ),
]


def test_enough_malformed_cases():
    assert len(MALFORMED) >= 50
    assert len({c[0] for c in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize(
    "make, field, fragment", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_payload_raises_payload_error(base, make, field, fragment):
    raw = make(base)
    with pytest.raises(PayloadError) as ei:
        decode_payload(raw)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.field == field
    assert fragment in str(err)
    if field:
        assert f"'{field}'" in str(err) or field == "version"
    # the same payload inside a request body
    if isinstance(raw, (str, dict)):
        with pytest.raises(PayloadError):
            payload_from_request({"custom_params": {"agentkv": raw}})


def test_error_counts_are_reported(base):
    bad = _with(base, session_id="", node=5, policy={"method": "intentkv", "budget": 0})
    with pytest.raises(PayloadError, match=r"\(and 2 more\)"):
        decode_payload(bad)


# ----------------------------------------------------------------- JSON Schema

jsonschema = pytest.importorskip("jsonschema")


def test_checked_in_schema_matches_the_models():
    """docs/wire-protocol-v1.schema.json is generated; regenerate with
    ``python -c 'from agentkv.wire import write_schema; write_schema()'`` when models change."""
    assert json.loads(SCHEMA_FILE.read_text()) == json_schema()


def test_module_main_prints_the_schema():
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "agentkv.wire"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert json.loads(out) == json_schema()


def test_schema_is_a_valid_schema():
    cls = jsonschema.validators.validator_for(json_schema())
    cls.check_schema(json_schema())


def test_schema_validates_real_payloads(tau_trajs):
    validator = jsonschema.Draft202012Validator(json_schema())
    n = 0
    for k, traj in enumerate(tau_trajs[::10]):
        for end in (3, len(traj)):
            policy = POLICIES[(k + end) % len(POLICIES)]
            validator.validate(json.loads(encode_payload(_payload(traj[:end], policy))))
            n += 1
    for policy in POLICIES:
        validator.validate(json.loads(encode_payload(KVPayload(session_id="s", policy=policy))))
    assert n >= 40


@pytest.mark.parametrize(
    "case",
    [
        "unknown-top",
        "int-session",
        "empty-session",
        "long-session",
        "version-2",
        "policy-unknown",
        "budget-0",
        "budget-str",
        "decay-1",
        "policy-extra",
        "alloc-bits",
        "message-role",
        "message-semantic",
        "message-semantic-int",
        "part-modality",
        "part-chars",
        "message-extra",
    ],
)
def test_schema_rejects_what_the_decoder_rejects(base, case):
    make = next(c[1] for c in MALFORMED if c[0] == case)
    validator = jsonschema.Draft202012Validator(json_schema())
    assert not validator.is_valid(make(base))
