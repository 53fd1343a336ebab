"""schemathesis against the server's declared OpenAPI spec: generated requests, valid and
invalid, on every route; none may be a server error (5xx other than 503 "busy").

The engine has a tiny KV pool (127 slots), so a generated valid request decodes at most a
few dozen tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

EXAMPLES = int(os.environ.get("AGENTKV_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Any]:
    from agentkv.engine.engine import Engine
    from agentkv.engine.server import BackgroundServer

    with BackgroundServer(Engine(device="cpu", kv_slots=128, chunk_size=64)) as srv:
        yield srv


def test_no_server_errors(fuzz_server):
    root = fuzz_server.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{root}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/agentkv/sessions/{session_id}"} <= paths
    for op in operations:

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: report the case as found
        )
        def check(case: Any) -> None:
            _short_answers(case.body)
            response = case.call(base_url=root, timeout=120)
            assert response.status_code < 500 or response.status_code == 503, (
                case.as_curl_command(),
                response.text[:500],
            )
            if response.status_code >= 400:  # every error is OpenAI-shaped
                assert "error" in response.json(), response.text[:500]

        check()


def _short_answers(body: Any) -> None:
    """Cap the answer length of a generated body at 2 tokens where it is a valid count (the
    CPU model then answers in well under a second; bad counts stay as generated)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if key == "max_tokens" and key not in body or type(v) is int and v > 2:
            body[key] = 2
