"""KV telemetry for LangChain / LangGraph users: on every ``AIMessage``, and per node for a run.

The engine returns per-request KV telemetry as ``usage.agentkv``. ``ChatOpenAI`` keeps it for
a non-streamed call (``response_metadata["token_usage"]["agentkv"]``) and drops it from a
stream (it arrives in the last chunk, which ``ChatOpenAI`` reduces to ``usage_metadata``).

:class:`KVUsageTap` is an inline callback handler that puts it back: at
``on_chat_model_start`` it opens a capture for the run (the instrumented OpenAI SDK watches
the run's stream, see :func:`agentkv.integrations.openai.begin_capture`), and it copies the
captured dict into ``response_metadata["agentkv"]`` of the chunk that carried it
(``on_llm_new_token``, so ``stream_mode="messages"`` consumers see it) and of the final
message (``on_llm_end``). ``with_kv_policy``'s handler and :class:`KVUsageCallbackHandler`
are taps; :func:`agentkv.usage` reads the dict from any of those messages.

:class:`KVUsageCallbackHandler` also collects every request's telemetry with the node that
made it; :meth:`~KVUsageCallbackHandler.by_node` aggregates them per node.
:func:`get_kv_usage_callback` is the context-manager form, like LangChain's
``get_usage_metadata_callback``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

from agentkv.kv_usage import aggregate_by_node
from agentkv.kv_usage import usage as read_usage

from . import openai as _openai

__all__ = ["KVUsageCallbackHandler", "KVUsageTap", "get_kv_usage_callback"]

WIRE_KEY = "agentkv"


def _attach(message: Any, found: dict[str, Any] | None) -> None:
    """Put ``found`` in ``message.response_metadata["agentkv"]`` unless it has one."""
    meta = getattr(message, "response_metadata", None)
    if found is not None and isinstance(meta, dict) and WIRE_KEY not in meta:
        meta[WIRE_KEY] = found


class KVUsageTap(BaseCallbackHandler):
    """Puts the engine's ``usage.agentkv`` on the messages of LangChain chat-model runs,
    streamed or not (``response_metadata["agentkv"]``). Inline: it runs in the model's own
    thread / asyncio task, where the model then calls the API."""

    run_inline = True

    def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[Any]], *, run_id: UUID, **kwargs: Any
    ) -> None:
        _openai.begin_capture(run_id)

    def on_llm_new_token(
        self, token: str, *, chunk: Any = None, run_id: UUID, **kwargs: Any
    ) -> None:
        if chunk is not None:
            message = getattr(chunk, "message", None)
            if isinstance(getattr(message, "response_metadata", None), dict):
                _attach(message, _openai.take_captured(run_id))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        found = _openai.end_capture(run_id)
        for generations in getattr(response, "generations", None) or []:
            for generation in generations:
                _attach(getattr(generation, "message", None), found)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        _openai.end_capture(run_id)


class KVUsageCallbackHandler(KVUsageTap):
    """Collects the KV telemetry of every chat-model call of the runs it is passed to.

    ``app.invoke(x, {"callbacks": [handler]})``, then ``handler.requests`` (one telemetry
    dict per call, in the order calls ended; each has the ``node`` that made it) and
    ``handler.by_node()`` (one aggregate row per node, see
    :func:`agentkv.aggregate_by_node`). Thread-safe; reusable across runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._nodes: dict[UUID, str | None] = {}
        self.requests: list[dict[str, Any]] = []

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().on_chat_model_start(serialized, messages, run_id=run_id, **kwargs)
        with self._lock:
            self._nodes[run_id] = (metadata or {}).get("langgraph_node")

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        super().on_llm_end(response, run_id=run_id, **kwargs)
        with self._lock:
            node = self._nodes.pop(run_id, None)
        for generations in getattr(response, "generations", None) or []:
            for generation in generations:
                message = getattr(generation, "message", None)
                found = read_usage(message) if message is not None else None
                if found is not None:
                    if found.get("node") is None and node is not None:
                        found = {**found, "node": node}
                    with self._lock:
                        self.requests.append(found)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        super().on_llm_error(error, run_id=run_id, **kwargs)
        with self._lock:
            self._nodes.pop(run_id, None)

    def by_node(self) -> dict[str, dict[str, Any]]:
        """Per-node aggregate of :attr:`requests` (see :func:`agentkv.aggregate_by_node`)."""
        with self._lock:
            return aggregate_by_node(list(self.requests))


_KV_USAGE_CALLBACK: ContextVar[KVUsageCallbackHandler | None] = ContextVar(
    "agentkv_kv_usage_callback", default=None
)
register_configure_hook(_KV_USAGE_CALLBACK, inheritable=True)


@contextmanager
def get_kv_usage_callback() -> Iterator[KVUsageCallbackHandler]:
    """A :class:`KVUsageCallbackHandler` attached to every LangChain run started inside the
    ``with`` block (LangChain's ``get_usage_metadata_callback`` pattern)."""
    handler = KVUsageCallbackHandler()
    token = _KV_USAGE_CALLBACK.set(handler)
    try:
        yield handler
    finally:
        _KV_USAGE_CALLBACK.reset(token)
