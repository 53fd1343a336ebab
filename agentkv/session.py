"""Session ids: stable across the turns of one conversation, different across conversations.

Resolution order (IntentKV appendix A, client side):

1. an explicit id given by the caller;
2. LangGraph's ``thread_id`` plus the checkpoint namespace's node path (task ids stripped,
   since LangGraph mints a new task id per step and the id must stay stable across turns);
3. a hash of the conversation's opening: the system prompt(s) and the first user message;
4. a request-local key (random) that never matches another request, when there is no user
   message to anchor on.

Ids the user gave are used as given, so that the id the user knows is the one the server
reports (``usage.agentkv.session_id``) and serves (``GET /v1/agentkv/sessions/{id}``): an
explicit ``session_id="user-42"`` is ``user-42``, and the nodes of a graph run on thread
``user-42`` share the session ``user-42`` (a subgraph's nodes get ``user-42/<subgraph node>``).
Ids agentkv derives itself carry a prefix (``task:``, ``req:``), which a given id may not
start with, so the sources never collide.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

from agentkv.annotation import openai_view


def checkpoint_node_path(checkpoint_ns: str | None) -> str:
    """``"outer:4f1e...|inner:9a2b..."`` -> ``"outer/inner"`` (LangGraph checkpoint namespace)."""
    if not checkpoint_ns:
        return ""
    return "/".join(seg.split(":", 1)[0] for seg in checkpoint_ns.split("|") if seg)


def task_hash(messages: Sequence[Any]) -> str | None:
    """Hash of the system prompt(s) and the first user message, or None without a user message."""
    opening: list[Any] = []
    for m in messages:
        view = openai_view(m)
        if view["role"] in {"system", "developer"}:
            opening.append(view.get("content"))
        elif view["role"] == "user":
            opening.append(view.get("content"))
            blob = json.dumps(opening, sort_keys=True, default=str).encode()
            return hashlib.sha256(blob).hexdigest()[:24]
    return None


#: Prefixes of the ids agentkv derives; an id the user gives may not start with one.
DERIVED_PREFIXES = ("task:", "req:")


def check_session_id(session_id: str, what: str = "session_id") -> str:
    """``session_id`` if a user may give it, else ``ValueError`` naming ``what``."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"{what}: expected a non-empty string, got {session_id!r}")
    if session_id.startswith(DERIVED_PREFIXES):
        raise ValueError(
            f"{what}: {session_id!r} starts with {session_id.split(':')[0]}:, a prefix agentkv "
            "keeps for the ids it derives; choose another id"
        )
    if len(session_id) > 512:
        raise ValueError(f"{what}: at most 512 characters, got {len(session_id)}")
    return session_id


def resolve_session_id(
    explicit: str | None = None,
    *,
    thread_id: str | None = None,
    checkpoint_ns: str | None = None,
    messages: Sequence[Any] | None = None,
) -> str:
    """The session id for one request (see module docstring for the order)."""
    if explicit:
        return check_session_id(explicit)
    if thread_id:
        path = checkpoint_node_path(checkpoint_ns)
        return check_session_id(str(thread_id) + (f"/{path}" if path else ""), "thread_id")
    digest = task_hash(messages or [])
    if digest:
        return f"task:{digest}"
    return f"req:{uuid.uuid4().hex}"


def is_request_local(session_id: str) -> bool:
    """True for ids that must never match another request (no memory kept for them)."""
    return session_id.startswith("req:")


def scope_session_id(namespace: str | None, session_id: str) -> str:
    """The engine-side key of a client's session id inside a tenant namespace.

    ``namespace`` is an opaque tenant scope (no ``@``; the server derives it from the API key
    and the request's ``cache_salt``): two tenants' equal session ids never meet. The scope
    is a suffix, so the id's source prefix (``req:`` ...) keeps its meaning. ``None``: as is.
    """
    return session_id if namespace is None else f"{session_id}@{namespace}"


def unscope_session_id(namespace: str | None, scoped: str) -> str:
    """Inverse of :func:`scope_session_id` (what a client is shown)."""
    suffix = f"@{namespace}"
    return scoped[: -len(suffix)] if namespace is not None and scoped.endswith(suffix) else scoped
