"""OpenAI SDK integration: :func:`kv_client` and the chat-completions instrumentation.

How it works (the way OpenTelemetry's OpenAI instrumentor does it): :func:`instrument` wraps
``openai.resources.chat.completions.Completions.create`` / ``.parse`` and their ``Async``
twins once, idempotently. ``.stream()``, ``with_raw_response`` and ``with_streaming_response``
all go through those methods. The wrapper is a pass-through unless a *source* claims the
call:

1. a client returned by :func:`kv_client` (looked up by the client object, weakly);
2. a resolver registered by another integration (``agentkv.integrations.langgraph`` claims
   calls made inside a run wrapped by ``with_kv_policy``, keyed on the current runnable
   config).

A claimed call gets its ``messages`` kwarg (the messages actually sent) annotated, and the
payload merged into ``extra_body["custom_params"]["agentkv"]`` (other ``extra_body`` keys and
other ``custom_params`` are kept). A call that already carries an agentkv payload is left
alone, so an explicit payload always wins. :func:`uninstrument` turns it all off.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import openai
from openai.resources.chat.completions import AsyncCompletions, Completions

from agentkv.policies import KVPolicy
from agentkv.session import resolve_session_id
from agentkv.wire import KVPayload, build_payload, to_extra_body

from .run_context import PolicyLike, coerce_policy, has_payload

__all__ = ["instrument", "is_instrumented", "kv_client", "uninstrument"]

ClientT = TypeVar("ClientT", openai.OpenAI, openai.AsyncOpenAI)
#: Builds the payload from the messages about to be sent.
PayloadFactory = Callable[[Sequence[Any]], KVPayload]
#: Given the ``Completions`` resource being called, a factory if the source claims the call.
Resolver = Callable[[Any], "PayloadFactory | None"]

_TARGETS: tuple[tuple[type, str, bool], ...] = (
    (Completions, "create", False),
    (Completions, "parse", False),
    (AsyncCompletions, "create", True),
    (AsyncCompletions, "parse", True),
)
_MARK = "__agentkv_original__"
_LOCK = threading.Lock()
_ENABLED = False
_RESOLVERS: list[Resolver] = []


@dataclass(frozen=True)
class _Binding:
    policy: KVPolicy
    session_id: str | None
    node: str | None

    def payload(self, messages: Sequence[Any]) -> KVPayload:
        session = resolve_session_id(self.session_id, messages=messages)
        return build_payload(messages, self.policy, session, node=self.node)


_BINDINGS: weakref.WeakKeyDictionary[Any, _Binding] = weakref.WeakKeyDictionary()


def _factory_for(resource: Any) -> PayloadFactory | None:
    client = getattr(resource, "_client", None)
    binding = _BINDINGS.get(client) if client is not None else None
    if binding is not None:
        return binding.payload
    for resolve in tuple(_RESOLVERS):
        factory = resolve(resource)
        if factory is not None:
            return factory
    return None


def _annotate(resource: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a ``create``/``parse`` call, with the agentkv payload when claimed."""
    if not _ENABLED or has_payload(kwargs.get("extra_body")) or "messages" not in kwargs:
        return kwargs
    factory = _factory_for(resource)
    if factory is None:
        return kwargs
    messages = kwargs["messages"]
    if not isinstance(messages, (list, tuple)):  # a one-shot iterable: read it once
        messages = list(messages)
    payload = factory(messages)
    return {
        **kwargs,
        "messages": messages,
        "extra_body": to_extra_body(payload, kwargs.get("extra_body")),
    }


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **_annotate(self, kwargs))

    setattr(wrapper, _MARK, original)
    return wrapper


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await original(self, *args, **_annotate(self, kwargs))

    setattr(wrapper, _MARK, original)
    return wrapper


def instrument() -> None:
    """Wrap the OpenAI chat-completions methods and enable them (idempotent, thread-safe).

    Runs when this module is imported (``agentkv.integrations.langgraph`` imports it), and
    again from ``kv_client`` and ``with_kv_policy``. Inert by itself: only calls claimed by
    a :func:`kv_client` client or made inside a wrapped LangGraph run are annotated.

    Import agentkv's integrations before a client makes its first call: the SDK caches
    ``with_raw_response`` per client with the ``create`` it saw at that moment.
    """
    global _ENABLED
    with _LOCK:
        for cls, name, is_async in _TARGETS:
            current = getattr(cls, name)
            if getattr(current, _MARK, None) is None:
                setattr(cls, name, (_wrap_async if is_async else _wrap_sync)(current))
        _ENABLED = True


def uninstrument(*, restore: bool = False) -> None:
    """Turn the instrumentation off: every call passes through unchanged.

    The wrappers stay in place (a flag check per call) unless ``restore=True``, which also
    puts the original methods back. Restoring has a catch: helpers that the SDK caches per
    client, such as ``with_raw_response`` (which ``ChatOpenAI`` uses for every
    non-streaming call), keep whichever ``create`` they saw first, so a client that makes
    its first call while the originals are back is never annotated again. ``kv_client``
    clients and wrapped graphs send no payload until :func:`instrument` runs again.
    """
    global _ENABLED
    with _LOCK:
        _ENABLED = False
        if not restore:
            return
        for cls, name, _ in _TARGETS:
            current = cls.__dict__.get(name)
            original = getattr(current, _MARK, None) if current is not None else None
            # only unwrap when agentkv's wrapper is on top (another instrumentor may have
            # wrapped it since; then it stays in that chain, passing everything through)
            if original is not None and getattr(current, "__wrapped__", None) is original:
                setattr(cls, name, original)


def is_instrumented() -> bool:
    """True while the instrumentation is installed and enabled."""
    return _ENABLED


def add_resolver(resolver: Resolver) -> None:
    """Register a source of payloads for un-bound clients (idempotent; for integrations)."""
    with _LOCK:
        if resolver not in _RESOLVERS:
            _RESOLVERS.append(resolver)


def kv_client(
    client: ClientT,
    policy: PolicyLike | None = None,
    *,
    session_id: str | None = None,
    node: str | None = None,
) -> ClientT:
    """A copy of ``client`` whose ``chat.completions`` calls carry the agentkv payload.

    ``policy``: a policy (``IntentKV(budget=512)``), its wire dict or a CLI spec string;
    default ``FullCache()``. ``session_id``: explicit session; None derives it from each
    request's messages (system prompt + first user message, see
    :func:`agentkv.resolve_session_id`). ``node``: label sent as the payload's node.

    The copy is a real ``OpenAI`` / ``AsyncOpenAI`` (``client.with_options()``, same
    connection pool); ``client`` itself is left unchanged. ``create``, ``parse``,
    ``stream``, ``with_raw_response`` and ``with_streaming_response`` are covered; a user
    ``extra_body`` and its ``custom_params`` are merged, never replaced. Copies made later
    from the returned client with ``with_options`` are plain clients again.
    """
    if not isinstance(client, (openai.OpenAI, openai.AsyncOpenAI)):
        raise TypeError(
            f"kv_client expects openai.OpenAI or openai.AsyncOpenAI, got {type(client).__name__}"
        )
    binding = _Binding(coerce_policy(policy), session_id, node)
    instrument()
    wrapped = client.with_options()
    with _LOCK:
        _BINDINGS[wrapped] = binding
    return wrapped


instrument()
