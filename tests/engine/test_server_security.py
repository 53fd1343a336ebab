"""Multi-tenant safety of ``agentkv serve``: API keys, tenant / cache-salt namespaces for the
prefix cache and sessions, no telemetry about another tenant's cache, the admin flush."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from agentkv.engine.tenancy import ServerOptions

pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")

KEY_A, KEY_B, ADMIN = "key-tenant-a", "key-tenant-b", "key-admin"


@pytest.fixture(scope="module")
def secure(engine) -> Iterator[Any]:
    """The shared engine behind a server with two tenants' keys and an admin key."""
    from agentkv.engine.server import BackgroundServer

    opts = ServerOptions(api_keys=(KEY_A, KEY_B), admin_api_key=ADMIN)
    with BackgroundServer(engine, options=opts) as srv:
        yield srv


def client_for(server: Any, key: str | None) -> httpx.Client:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url.removesuffix("/v1"), headers=headers, timeout=120)


@pytest.fixture
def tenant_a(secure) -> Iterator[httpx.Client]:
    with client_for(secure, KEY_A) as c:
        yield c


@pytest.fixture
def tenant_b(secure) -> Iterator[httpx.Client]:
    with client_for(secure, KEY_B) as c:
        yield c


def secret_chat(sid: str, secret: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"[{sid}] The vault code is {secret}. Never reveal it."},
        {"role": "user", "content": "Hello."},
    ]


def chat(http: httpx.Client, messages, session: str | None = None, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 1, **extra}
    if session is not None:
        p = {"version": 1, "session_id": session, "policy": {"method": "full"}}
        body["custom_params"] = {"agentkv": json.dumps(p)}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["agentkv"]


def test_another_tenant_never_hits_a_tenants_prompt(tenant_a, tenant_b, sid):
    """The issue's attack: B sends A's exact prompt (or guesses of it) and reads
    ``prefix_hit_tokens``. With tenant namespaces B only ever hits its own cache."""
    messages = secret_chat(sid, "7391-ALPHA-ZEBRA")
    first = chat(tenant_a, messages)
    assert chat(tenant_a, messages)["prefix_hit_tokens"] >= first["prompt_tokens"] - 1
    assert chat(tenant_b, messages)["prefix_hit_tokens"] == 0
    # B's own earlier request is B's to reuse (the cache still works per tenant)
    assert chat(tenant_b, messages)["prefix_hit_tokens"] > 0


def test_cache_salt_separates_namespaces_without_keys(http, sid):
    """No keys: one anonymous tenant; vLLM's ``cache_salt`` still scopes reuse."""
    messages = secret_chat(sid, "salted")
    chat(http, messages, cache_salt=f"{sid}-1")
    assert chat(http, messages, cache_salt=f"{sid}-1")["prefix_hit_tokens"] > 0
    assert chat(http, messages, cache_salt=f"{sid}-2")["prefix_hit_tokens"] == 0
    # no salt: its own namespace (others' requests there share at most the template's start)
    assert chat(http, messages)["prefix_hit_tokens"] < 8


def test_keys_are_required_on_v1_routes(secure, tenant_a):
    for key in (None, "wrong-key", KEY_A + "x"):
        with client_for(secure, key) as c:
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")]:
                r = c.request(method, path, json={"messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 401, (key, path, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
                assert r.headers["www-authenticate"] == "Bearer"
            assert c.get("/health").status_code == 200
    assert tenant_a.get("/v1/models").status_code == 200
    with client_for(secure, ADMIN) as admin:  # the admin key is not a tenant key
        assert admin.get("/v1/models").status_code == 401


def test_sessions_are_scoped_to_the_tenant(tenant_a, tenant_b, sid):
    messages = secret_chat(sid, "session")
    usage = chat(tenant_a, messages, session=sid)
    assert usage["session_id"] == sid  # clients see their own id, not the scoped key
    path = f"/v1/agentkv/sessions/{sid}"
    assert tenant_b.get(path).status_code == 404
    assert tenant_b.delete(path).status_code == 404
    # B reusing the id gets its own session: A's telemetry and cache are untouched
    b_usage = chat(tenant_b, messages, session=sid)  # hits at most B's own template prefix
    assert b_usage["session_id"] == sid and b_usage["prefix_hit_tokens"] < 8
    a = tenant_a.get(path).json()
    assert a["session_id"] == sid and a["requests"] == 1
    assert tenant_b.get(path).json()["requests"] == 1
    # a session under a cache salt is found with that salt
    chat(tenant_a, messages, session=f"{sid}-salted", cache_salt="s1")
    assert tenant_a.get(f"{path}-salted").status_code == 404
    assert tenant_a.get(f"{path}-salted", params={"cache_salt": "s1"}).status_code == 200
    assert tenant_a.delete(f"{path}-salted", params={"cache_salt": "s1"}).status_code == 200
    # DELETE: 200 once, then 404 like GET
    assert tenant_a.delete(path).status_code == 200
    r = tenant_a.delete(path)
    assert r.status_code == 404 and r.json()["error"]["param"] == "session_id"
    assert tenant_b.delete(path).status_code == 200
    assert tenant_b.delete(f"/v1/agentkv/sessions/never-{sid}").status_code == 404


def test_flush_needs_the_admin_key_and_empties_the_cache(secure, tenant_a, engine, sid):
    messages = secret_chat(sid, "flush")
    chat(tenant_a, messages)
    assert chat(tenant_a, messages)["prefix_hit_tokens"] > 0
    r = tenant_a.post("/v1/agentkv/flush")
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with client_for(secure, ADMIN) as admin:
        r = admin.post("/v1/agentkv/flush")
    assert r.status_code == 200, r.text
    stats = engine.store.stats()
    assert r.json()["free_slots"] == stats.free_slots == stats.capacity
    assert stats.prefix_cache_nodes == 0
    engine.store.check_invariants()
    assert chat(tenant_a, messages)["prefix_hit_tokens"] == 0


def test_options_from_env(monkeypatch):
    monkeypatch.setenv("AGENTKV_API_KEY", "k1, k2,")
    monkeypatch.setenv("AGENTKV_ADMIN_API_KEY", "adm")
    opts = ServerOptions.from_env()
    assert opts.api_keys == ("k1", "k2") and opts.admin_api_key == "adm"
    assert ServerOptions.from_env(["flag"]).api_keys == ("flag",)  # a flag wins over the env


def test_another_tenant_cannot_perturb_a_sessions_query_memory(
    secure, tenant_a, tenant_b, engine, sid
):
    """The issue's second finding: an explicit ``session_id`` from another client joined that
    session's IntentKV QueryMemory. Now each tenant's id names its own session."""
    import torch

    from agentkv.policies import IntentKV
    from agentkv.session import scope_session_id

    tenancy = secure.config.app.state.tenancy
    ns_a = tenancy.namespace(tenancy.tenant(f"Bearer {KEY_A}"))
    memory = engine.methods.for_policy(IntentKV()).memory
    p = {"version": 1, "session_id": sid, "policy": {"method": "intentkv", "budget": 8}}
    body = {"messages": secret_chat(sid, "memory"), "max_tokens": 1}
    body["custom_params"] = {"agentkv": json.dumps(p)}
    assert tenant_a.post("/v1/chat/completions", json=body).status_code == 200
    before = memory.get(scope_session_id(ns_a, sid))
    assert before is not None
    other = {**body, "messages": [{"role": "user", "content": "Something else entirely."}]}
    assert tenant_b.post("/v1/chat/completions", json=other).status_code == 200
    after = memory.get(scope_session_id(ns_a, sid))
    assert after is not None and torch.equal(before, after)
    assert tenant_a.delete(f"/v1/agentkv/sessions/{sid}").status_code == 200
    assert tenant_b.delete(f"/v1/agentkv/sessions/{sid}").status_code == 200
    assert scope_session_id(ns_a, sid) not in memory
