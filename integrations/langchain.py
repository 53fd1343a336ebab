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
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse

from agentkv.session import resolve_session_id
from agentkv.wire import build_payload, to_extra_body

from .run_context import (
    PolicyLike,
    RunContext,
    coerce_policy,
    has_payload,
    make_run_context,
    run_context,
)

__all__ = ["KVPolicyMiddleware"]


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
        self.session_id = session_id
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
        return handler(self.annotate(request))

    async def awrap_model_call(
        self,
        request: ModelRequest,
        handler: Callable[[ModelRequest], Awaitable[ModelResponse]],
    ) -> Any:
        return await handler(self.annotate(request))
