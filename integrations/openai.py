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

Around a claimed call the wrapper also:

- asks the server, once per base URL and method, whether it implements the policy's method
  (``GET /v1/agentkv/capabilities``) and warns
  (:class:`agentkv.UnimplementedPolicyWarning`) when it does not;
- turns a connection failure into an ``openai.APIConnectionError`` that names the URL and
  says to start ``agentkv serve``.

Streamed telemetry: the engine sends ``usage.agentkv`` in the last chunk of a stream, which
``ChatOpenAI`` drops. While a LangChain chat-model run has opened a capture
(:func:`begin_capture`, done by agentkv's callback handlers), the stream's chunks are
watched and that dict is kept for the run (:func:`captured`), whether or not the call was
claimed.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar
from uuid import UUID

import openai
from openai.resources.chat.completions import AsyncCompletions, Completions

from agentkv.kv_usage import usage as read_usage
from agentkv.policies import KVPolicy
from agentkv.server_capabilities import fetch_capabilities, warn_unimplemented
from agentkv.session import check_session_id, resolve_session_id
from agentkv.wire import KVPayload, build_payload, to_extra_body

from .run_context import PolicyLike, coerce_policy, has_payload

__all__ = [
    "begin_capture",
    "check_server",
    "take_captured",
    "end_capture",
    "instrument",
    "is_instrumented",
    "kv_client",
    "uninstrument",
]

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


def _annotate(resource: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], KVPayload | None]:
    """``kwargs`` of a ``create``/``parse`` call, with the agentkv payload when claimed, and
    that payload (None when the call is not claimed)."""
    if not _ENABLED or has_payload(kwargs.get("extra_body")) or "messages" not in kwargs:
        return kwargs, None
    factory = _factory_for(resource)
    if factory is None:
        return kwargs, None
    messages = kwargs["messages"]
    if not isinstance(messages, (list, tuple)):  # a one-shot iterable: read it once
        messages = list(messages)
    payload = factory(messages)
    kwargs = {
        **kwargs,
        "messages": messages,
        "extra_body": to_extra_body(payload, kwargs.get("extra_body")),
    }
    return kwargs, payload


# ---------------------------------------------------------------- server checks
#: (base URL, method) pairs already checked against the server's capabilities.
_CHECKED: set[tuple[str, str]] = set()


def _base_url(resource: Any) -> str:
    client = getattr(resource, "_client", None)
    return str(getattr(client, "base_url", "") or "").rstrip("/")


def _needs_check(resource: Any, payload: KVPayload | None) -> bool:
    return payload is not None and (_base_url(resource), payload.policy.method) not in _CHECKED


def check_server(
    base_url: str,
    policies: Sequence[KVPolicy],
    api_key: str | None = None,
    *,
    once: bool = False,
    stacklevel: int = 2,
) -> None:
    """Warn (:func:`agentkv.warn_unimplemented`) when the server at ``base_url`` does not
    implement a policy's method. Wrap-time checks warn every time; ``once=True`` (the
    first request) skips (base URL, method) pairs checked before. A server that cannot say
    (unreachable, not an agentkv engine) is asked again at the next check."""
    url = str(base_url).rstrip("/")
    with _LOCK:
        todo = [p for p in policies if not once or (url, p.method) not in _CHECKED]
    if not url or not todo:
        return
    warn_unimplemented(url, todo, api_key=api_key, stacklevel=stacklevel + 1)
    if fetch_capabilities(url, api_key=api_key) is not None:  # cached: no second request
        with _LOCK:
            _CHECKED.update((url, p.method) for p in todo)


def _check_server(resource: Any, payload: KVPayload) -> None:
    client = getattr(resource, "_client", None)
    check_server(
        _base_url(resource),
        [payload.policy],
        getattr(client, "api_key", None),
        once=True,
        stacklevel=4,
    )


def _unreachable(resource: Any, e: openai.APIConnectionError) -> openai.APIConnectionError:
    return openai.APIConnectionError(
        message=(
            f"agentkv: the server at {_base_url(resource)} is not reachable ({e.message}); "
            "start it with `agentkv serve` or point base_url at a running one"
        ),
        request=e.request,
    )


# ---------------------------------------------------------------- streamed telemetry
#: The LangChain chat-model run whose API calls are being made in this context.
_CAPTURE_RUN: ContextVar[UUID | None] = ContextVar("agentkv_capture_run", default=None)
#: Open captures: run id -> [the ``usage.agentkv`` dict seen for it (None until seen),
#: whether it was handed out by :func:`take_captured`].
_CAPTURES: dict[UUID, list[Any]] = {}


def begin_capture(run_id: UUID) -> None:
    """Open a capture for a chat-model run: API calls made next in this context (thread,
    asyncio task) keep their ``usage.agentkv`` for it. Idempotent."""
    with _LOCK:
        _CAPTURES.setdefault(run_id, [None, False])
    _CAPTURE_RUN.set(run_id)


def take_captured(run_id: UUID) -> dict[str, Any] | None:
    """The telemetry captured for an open run, once (later calls: None)."""
    with _LOCK:
        entry = _CAPTURES.get(run_id)
        if entry is None or entry[0] is None or entry[1]:
            return None
        entry[1] = True
        return entry[0]


def end_capture(run_id: UUID) -> dict[str, Any] | None:
    """Close a run's capture; returns what it captured unless :func:`take_captured` handed
    it out already."""
    with _LOCK:
        entry = _CAPTURES.pop(run_id, None)
    return None if entry is None or entry[1] else entry[0]


def _keep(run_id: UUID, item: Any) -> None:
    try:
        found = read_usage(item)
    except TypeError:
        return
    if found is not None:
        with _LOCK:
            if run_id in _CAPTURES:
                _CAPTURES[run_id][0] = found


def _tap(result: Any) -> Any:
    """Watch ``result`` (a response or a stream) for the open capture of this context."""
    run_id = _CAPTURE_RUN.get()
    if run_id is None or run_id not in _CAPTURES:
        return result
    if isinstance(result, openai.Stream):
        inner = result._iterator

        def watched() -> Any:
            for item in inner:
                _keep(run_id, item)
                yield item

        result._iterator = watched()
    elif isinstance(result, openai.AsyncStream):
        ainner = result._iterator

        async def awatched() -> Any:
            async for item in ainner:
                _keep(run_id, item)
                yield item

        result._iterator = awatched()
    elif isinstance(result, Mapping) or hasattr(result, "choices"):
        _keep(run_id, result)
    return result


def _reraise_unreachable(
    client: Any, e: openai.APIConnectionError, payload: Any, kwargs: dict[str, Any]
) -> NoReturn:
    """A connection error of an agentkv call says which server was not reachable (timeouts,
    a subclass, and calls without an agentkv payload are re-raised as they are)."""
    if isinstance(e, openai.APITimeoutError) or (
        payload is None and not has_payload(kwargs.get("extra_body"))
    ):
        raise e
    raise _unreachable(client, e) from e


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs, payload = _annotate(self, kwargs)
        if _needs_check(self, payload):
            _check_server(self, payload)
        try:
            result = original(self, *args, **kwargs)
        except openai.APIConnectionError as e:
            _reraise_unreachable(self, e, payload, kwargs)
        return _tap(result) if _ENABLED else result

    setattr(wrapper, _MARK, original)
    return wrapper


def _wrap_async(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs, payload = _annotate(self, kwargs)
        if _needs_check(self, payload):  # a blocking HTTP GET, once: off the event loop
            await asyncio.to_thread(_check_server, self, payload)
        try:
            result = await original(self, *args, **kwargs)
        except openai.APIConnectionError as e:
            _reraise_unreachable(self, e, payload, kwargs)
        return _tap(result) if _ENABLED else result

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
    default ``FullCache()``. ``session_id``: explicit session, used as given (it is the id
    ``usage.agentkv`` reports and ``GET /v1/agentkv/sessions/{id}`` serves); None derives
    it from each request's messages (system prompt + first user message, see
    :func:`agentkv.resolve_session_id`). ``node``: label sent as the payload's node.

    Asks the server which methods it implements (``GET /v1/agentkv/capabilities``, cached
    per base URL) and warns (:class:`agentkv.UnimplementedPolicyWarning`) when ``policy``'s
    is not one of them; an unreachable server gives no warning here.

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
    if session_id is not None:
        check_session_id(session_id)
    binding = _Binding(coerce_policy(policy), session_id, node)
    check_server(str(client.base_url), [binding.policy], client.api_key)
    instrument()
    wrapped = client.with_options()
    with _LOCK:
        _BINDINGS[wrapped] = binding
    return wrapped


instrument()
