"""The client side imports without torch, triton or transformers (checked in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "triton", "transformers", "sglang")

CLIENT_MODULES = [
    "agentkv",
    "agentkv.tags",
    "agentkv.annotation",
    "agentkv.session",
    "agentkv.policies",
    "agentkv.wire",
    "agentkv.kv_usage",
    "agentkv.server_capabilities",
]


def _loaded_after(code: str) -> dict:
    probe = (
        f"{code}\n"
        "import json, sys\n"
        f"print(json.dumps({{m: m in sys.modules for m in {list(HEAVY)!r}}}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CLIENT_MODULES)
def test_client_modules_stay_light(module):
    loaded = _loaded_after(f"import {module}")
    assert not any(loaded.values()), (
        f"import {module} pulled in {[m for m, v in loaded.items() if v]}"
    )


def test_using_the_client_api_stays_light():
    code = """
import agentkv
from agentkv import IntentKV, build_payload, encode_payload, decode_payload, resolve_session_id
msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
p = build_payload(msgs, IntentKV(budget=64), resolve_session_id(messages=msgs), node="agent")
assert decode_payload(encode_payload(p)) == p
agentkv.parse_policy_spec("h2o:budget=64")
"""
    loaded = _loaded_after(code)
    assert not any(loaded.values()), loaded
