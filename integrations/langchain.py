"""LangChain v1 integration: :class:`KVPolicyMiddleware` for ``create_agent``.

``wrap_model_call`` / ``awrap_model_call`` annotate the messages the model is about to
receive (``request.system_message`` + ``request.messages``) and put the payload in
``request.model_settings["extra_body"]`` through ``request.override``. ``create_agent``
binds ``model_settings`` onto the model (``model.bind_tools(..., **model_settings)``), so
``ChatOpenAI`` sends it as ``extra_body`` of the chat-completions request. Nothing is
written into the agent's graph state.

``extra_body`` merge: ``ChatOpenAI`` builds its request as ``{**defaults, **bound kwargs}``,
so a bound ``extra_body`` replaces the model's own. The middleware therefore starts from
``model_settings["extra_body"]`` if an earlier middleware set one, else from the model's
``model_kwargs["extra_body"]`` / ``extra_body``, and adds ``custom_params["agentkv"]`` to it.

Session id: explicit ``session_id`` > the thread (``configurable["thread_id"]`` plus the
agent's checkpoint namespace when it runs as a subgraph) > a hash of the conversation's
opening (system prompt + first user message).

Put it last in ``middleware=[...]`` (innermost) so that it sees the messages after other
middleware rewrote them.

Telemetry: around the model call the middleware attaches a
:class:`~agentkv.integrations.kv_usage_callback.KVUsageTap` (a LangChain configure hook),
so the model's ``AIMessage`` carries the engine's ``usage.agentkv`` in
``response_metadata["agentkv"]``, streamed or not (read it with :func:`agentkv.usage`).
Before its first call to a server, it asks the server whether it implements the policy's
method and warns if not (:class:`agentkv.UnimplementedPolicyWarning`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.tracers.context import register_configure_hook

from agentkv.session import check_session_id, resolve_session_id
from agentkv.wire import build_payload, to_extra_body

from . import openai as _openai
from .kv_usage_callback import KVUsageCallbackHandler, KVUsageTap, get_kv_usage_callback
from .run_context import (
    PolicyLike,
    RunContext,
    coerce_policy,
    has_payload,
    make_run_context,
    run_context,
)

__all__ = ["KVPolicyMiddleware", "KVUsageCallbackHandler", "get_kv_usage_callback"]

#: Set around a middleware's model call: LangChain adds it to the model run's callbacks.
_TAP_VAR: ContextVar[KVUsageTap | None] = ContextVar("agentkv_middleware_tap", default=None)
register_configure_hook(_TAP_VAR, inheritable=True)
_TAP = KVUsageTap()


@contextmanager
def _tapped() -> Iterator[None]:
    token = _TAP_VAR.set(_TAP)
    try:
        yield
    finally:
        _TAP_VAR.reset(token)


def _model_server(model: Any) -> tuple[str | None, str | None]:
    """(base URL, API key) of a ``ChatOpenAI`` (or a binding of one), else (None, None)."""
    model = getattr(model, "bound", model)
    url = getattr(model, "openai_api_base", None)
    client = getattr(model, "root_client", None)
    if url is None and client is not None:
        url = str(client.base_url)
    key = getattr(client, "api_key", None)
    return (str(url) if url else None), key


def _model_extra_body(model: Any) -> Mapping[str, Any] | None:
    """The ``extra_body`` the model would send by itself (``ChatOpenAI`` semantics)."""
    model_kwargs = getattr(model, "model_kwargs", None)
    if isinstance(model_kwargs, Mapping) and model_kwargs.get("extra_body") is not None:
        return model_kwargs["extra_body"]
    extra = getattr(model, "extra_body", None)
    return extra if isinstance(extra, Mapping) else None


def _request_context(request: ModelRequest) -> RunContext:
    """Where the model call runs: LangGraph's ``runtime.execution_info`` (thread id, task
    checkpoint namespace) when present, else the current runnable config."""
    info = getattr(request.runtime, "execution_info", None)
    if info is not None:
        return make_run_context(info.checkpoint_ns, thread_id=info.thread_id)
    return run_context()


class KVPolicyMiddleware(AgentMiddleware):
    """Send the agentkv payload (annotations, session id, node, policy) with every model call
    of a ``create_agent`` agent. Sync and async.

    ``policy``: a policy object, its wire dict or a CLI spec (default ``FullCache()``).
    ``session_id``: explicit session id (default: from the thread, else from the messages).
    ``node``: node label sent in the payload (default: LangGraph's node name, ``"model"``).
    """

    def __init__(
        self,
        policy: PolicyLike | None = None,
        *,
        session_id: str | None = None,
        node: str | None = None,
    ) -> None:
        super().__init__()
        self.policy = coerce_policy(policy)
        self.session_id = check_session_id(session_id) if session_id is not None else None
        self.node = node

    def annotate(self, request: ModelRequest) -> ModelRequest:
        """``request`` with the payload added to its ``model_settings["extra_body"]``."""
        settings = dict(request.model_settings)
        if "extra_body" in settings:
            base = settings["extra_body"]
        else:
            base = _model_extra_body(request.model)
        if has_payload(base):  # an explicit payload wins
            return request
        url, key = _model_server(request.model)
        if url:
            _openai.check_server(url, [self.policy], key, once=True, stacklevel=4)
        messages = list(request.messages)
        if request.system_message is not None:
            messages.insert(0, request.system_message)
        ctx = _request_context(request)
        session = resolve_session_id(
            self.session_id, thread_id=ctx.thread_id, checkpoint_ns=ctx.graph_ns, messages=messages
        )
        payload = build_payload(messages, self.policy, session, node=self.node or ctx.node)
        settings["extra_body"] = to_extra_body(payload, base)
        return request.override(model_settings=settings)

    def wrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], ModelResponse],
    ) -> Any:
        request = self.annotate(request)
        with _tapped():
            return handler(request)

    async def awrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> Any:
        request = self.annotate(request)
        with _tapped():
            return await handler(request)
