"""Session ids: stable across the turns of one conversation, different across conversations.

Resolution order (IntentKV appendix A, client side):

1. an explicit id given by the caller;
2. LangGraph's ``thread_id`` plus the checkpoint namespace's node path (task ids stripped,
   since LangGraph mints a new task id per step and the id must stay stable across turns);
3. a hash of the conversation's opening: the system prompt(s) and the first user message;
4. a request-local key (random) that never matches another request, when there is no user
   message to anchor on.

Ids from different sources carry different prefixes (``x:``, ``lg:``, ``task:``, ``req:``)
so that, e.g., a thread id can never collide with a task hash.
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


def resolve_session_id(
    explicit: str | None = None,
    *,
    thread_id: str | None = None,
    checkpoint_ns: str | None = None,
    messages: Sequence[Any] | None = None,
) -> str:
    """The session id for one request (see module docstring for the order)."""
    if explicit:
        return f"x:{explicit}"
    if thread_id:
        path = checkpoint_node_path(checkpoint_ns)
        return f"lg:{thread_id}" + (f"/{path}" if path else "")
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
