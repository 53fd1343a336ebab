"""LangGraph integration: :func:`with_kv_policy`.

``with_kv_policy(graph, default=..., nodes={...})`` validates the per-node overrides against
the graph's nodes (subgraphs included) and returns ``compiled.with_config(configurable=
{"agentkv": GraphPolicy(...)}, callbacks=[KVRunHandler(...)])``: LangGraph's ``with_config``
returns a copy of the compiled graph, so ``invoke``, ``stream``, ``ainvoke``, ``astream``,
``get_state``, ... work as before. Node code is not edited.

Mechanism: the OpenAI chat-completions methods are instrumented once (see
``agentkv.integrations.openai``); a request is claimed when it is made inside a wrapped run,
found through LangGraph's run metadata in one of two ways:

1. the chat model's run: :class:`KVRunHandler`, an inline callback handler inherited by
   every model run of the wrapped graph, records at ``on_chat_model_start`` the run's
   metadata (``langgraph_node``, ``langgraph_checkpoint_ns``, ``thread_id``) in a
   ``ContextVar`` that the model's API call, in the same thread / task, reads back;
2. the current runnable config (``get_config()``, a ``ContextVar`` LangGraph sets for the
   running node): covers OpenAI SDK calls made directly in a node's code. Its
   ``configurable["agentkv"]`` holds the policy; LangGraph passes it down to subgraphs.

The request then carries:

- ``node``: ``langgraph_node`` (the innermost node);
- the policy of the innermost node that has an override, else of the enclosing
  subgraph node, ..., else the default;
- ``session_id``: :func:`agentkv.resolve_session_id` of the ``thread_id`` and the checkpoint
  namespace of the graph running the node (the nodes of one graph share the session named
  by the thread id, ``<thread>``; a subgraph's nodes get ``<thread>/<subgraph node>``);
  without a thread id, a hash of the conversation's opening.

Call-time configuration follows LangGraph: the wrap-time :class:`~agentkv.GraphPolicy` is
the base, and a policy given for one run (``app.invoke(x, {"configurable": {"agentkv":
...}})``, ``app.with_config(configurable={"agentkv": ...})``, or an ``agentkv`` field of the
run's ``context``, langgraph >= 0.6) is merged on top (:func:`effective_policy`). Wrapping a
wrapped graph again merges the same way. The handler also taps the engine's telemetry into
``AIMessage.response_metadata["agentkv"]`` (see :mod:`.kv_usage_callback`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.runnables import Runnable, RunnableBinding
from langgraph.graph.state import StateGraph
from langgraph.pregel import Pregel

from agentkv.policies import GraphPolicy, KVPolicy, UnknownNodeError, unknown_node_message
from agentkv.session import resolve_session_id
from agentkv.wire import build_payload

from . import openai as _openai
from .kv_usage_callback import KVUsageCallbackHandler, get_kv_usage_callback
from .kv_usage_callback import KVUsageTap as _KVUsageTap
from .run_context import (
    PolicyLike,
    RunContext,
    coerce_policy,
    current_config,
    metadata_run_context,
    run_context,
)

__all__ = [
    "CONFIG_KEY",
    "KVRunHandler",
    "KVUsageCallbackHandler",
    "effective_policy",
    "get_kv_usage_callback",
    "graph_node_names",
    "policy_for_path",
    "with_kv_policy",
]

#: ``configurable`` key (and ``context`` field) that carries a run's policy.
CONFIG_KEY = "agentkv"
#: LangGraph's ``configurable`` key for the run's ``Runtime`` (``Runtime.context``).
_RUNTIME_KEY = "__pregel_runtime"


def _compiled(graph: Any, compile_kwargs: Mapping[str, Any]) -> tuple[Pregel, Runnable]:
    """(the Pregel graph to inspect, the runnable to bind)."""
    if isinstance(graph, StateGraph):
        compiled = graph.compile(**compile_kwargs)
        return compiled, compiled
    if compile_kwargs:
        raise TypeError(
            f"with_kv_policy: {', '.join(sorted(compile_kwargs))} only apply when the graph "
            "is compiled here; this graph is already compiled. Pass the StateGraph builder "
            f"(with_kv_policy(builder, ..., {next(iter(sorted(compile_kwargs)))}=...)) or "
            "give them to compile() yourself "
            "(with_kv_policy(builder.compile(checkpointer=...), ...))"
        )
    if isinstance(graph, Pregel):
        return graph, graph
    if isinstance(graph, RunnableBinding) and isinstance(graph.bound, Pregel):
        return graph.bound, graph
    raise TypeError(
        "with_kv_policy expects a StateGraph, a compiled graph, or a compiled graph's "
        f"with_config() binding; got {type(graph).__name__}"
    )


def graph_node_names(graph: Pregel) -> set[str]:
    """Node names valid as ``nodes`` keys: the graph's nodes, the nodes of every subgraph
    LangGraph finds (``get_subgraphs(recurse=True)``), and their ``/``-joined paths
    (``"research/search"``)."""
    names: set[str] = set()

    def add(g: Any, prefix: str) -> None:
        for name in getattr(g, "nodes", {}):
            if name.startswith("__"):  # __start__, __end__
                continue
            names.add(name)
            if prefix:
                names.add(f"{prefix}/{name}")

    add(graph, "")
    for namespace, sub in graph.get_subgraphs(recurse=True):
        add(sub, namespace.replace("|", "/"))
    return names


def policy_for_path(policy: GraphPolicy, path: Sequence[str], node: str | None = None) -> KVPolicy:
    """The policy of the innermost node of ``path`` that has an override (by full path or by
    name), else the default. ``node`` is used when ``path`` is empty."""
    path = tuple(path) or ((node,) if node else ())
    for i in range(len(path) - 1, -1, -1):
        for key in ("/".join(path[: i + 1]), path[i]):
            if key in policy.nodes:
                return policy.nodes[key]
    return policy.default


def as_graph_policy(value: Any) -> GraphPolicy:
    """A :class:`GraphPolicy` from what a user may pass for a run: a ``GraphPolicy`` or its
    dict (``{"default": ..., "nodes": {...}}``), or one policy (object, wire dict, spec
    string), which then replaces the default only."""
    if isinstance(value, GraphPolicy):
        return value
    if isinstance(value, (KVPolicy, str)) or (isinstance(value, Mapping) and "method" in value):
        return GraphPolicy(default=coerce_policy(value))
    if isinstance(value, Mapping):
        return GraphPolicy.model_validate(dict(value))
    raise TypeError(
        f"{CONFIG_KEY}: expected a GraphPolicy, a policy, a spec string or a dict; "
        f"got {type(value).__name__}"
    )


def _graph_policy(default: Any, nodes: Mapping[str, PolicyLike] | None) -> GraphPolicy:
    if isinstance(default, GraphPolicy):
        if nodes:
            raise TypeError("pass either a GraphPolicy or default= and nodes=, not both")
        return default
    if default is None:  # default not given: a merge keeps the base's default
        return GraphPolicy(nodes={name: coerce_policy(p) for name, p in (nodes or {}).items()})
    return GraphPolicy(
        default=coerce_policy(default),
        nodes={name: coerce_policy(p) for name, p in (nodes or {}).items()},
    )


def _context_value(config: Mapping[str, Any]) -> Any:
    """The ``agentkv`` field of the run's ``context`` (langgraph >= 0.6), or None."""
    runtime = (config.get("configurable") or {}).get(_RUNTIME_KEY)
    context = getattr(runtime, "context", None)
    if context is None:
        return None
    if isinstance(context, Mapping):
        return context.get(CONFIG_KEY)
    return getattr(context, CONFIG_KEY, None)


def effective_policy(
    base: GraphPolicy | None,
    config: Mapping[str, Any] | None,
    known_nodes: Iterable[str] | None = None,
) -> GraphPolicy | None:
    """The policy of one run: ``base`` (the wrap-time policy), then the run's
    ``configurable["agentkv"]``, then its ``context``'s ``agentkv`` (langgraph >= 0.6),
    each merged on top (:meth:`GraphPolicy.merged`: its nodes replace or add, its default
    replaces when given). A run value that is ``base`` itself is no override. Node names
    of overrides are checked against ``known_nodes`` when given
    (:class:`agentkv.UnknownNodeError`, with "did you mean")."""
    policy = base
    if config:
        for where, value in (
            (f'configurable["{CONFIG_KEY}"]', (config.get("configurable") or {}).get(CONFIG_KEY)),
            (f"context.{CONFIG_KEY}", _context_value(config)),
        ):
            if value is None or value is base:
                continue
            override = as_graph_policy(value)
            if known_nodes is not None:
                unknown = set(override.nodes) - set(known_nodes)
                if unknown:
                    raise UnknownNodeError(unknown_node_message(unknown, known_nodes, where))
            policy = override if policy is None else policy.merged(override)
    return policy


#: The chat-model run in progress in this context: (run id, its handler, where it runs).
_MODEL_RUN: ContextVar[tuple[UUID, KVRunHandler, RunContext] | None] = ContextVar(
    "agentkv_model_run", default=None
)
#: Chat-model runs started and not yet ended (a stale ``_MODEL_RUN`` value is ignored).
_ACTIVE_RUNS: set[UUID] = set()


class KVRunHandler(_KVUsageTap):
    """Callback handler that ``with_kv_policy`` adds to the wrapped graph's ``callbacks``.

    Holds the wrap-time policy and the graph's node names. On ``on_chat_model_start`` it
    records itself and LangGraph's run metadata (``langgraph_node``,
    ``langgraph_checkpoint_ns``, ``thread_id``) in a ``ContextVar``. ``run_inline`` makes
    LangChain call it in the model's own thread / asyncio task, right before the model calls
    the API, so the instrumented ``create`` sees the value. This path does not depend on
    LangGraph setting the current config for async nodes, which it cannot do before Python
    3.11. As a :class:`~agentkv.integrations.kv_usage_callback.KVUsageTap` it also puts the
    engine's telemetry on the model's messages.
    """

    def __init__(self, policy: GraphPolicy, nodes: Iterable[str] | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.nodes = frozenset(nodes) if nodes is not None else None

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
        _ACTIVE_RUNS.add(run_id)
        _MODEL_RUN.set((run_id, self, metadata_run_context(metadata)))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        super().on_llm_end(response, run_id=run_id, **kwargs)
        _ACTIVE_RUNS.discard(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        super().on_llm_error(error, run_id=run_id, **kwargs)
        _ACTIVE_RUNS.discard(run_id)

    def run_policy(self, config: Mapping[str, Any] | None) -> GraphPolicy:
        """This handler's policy with the run's overrides (from ``config``, the current
        runnable config) merged on top. Without a current config (a model called from a
        plain thread of your own), the wrap-time policy."""
        return effective_policy(self.policy, config, self.nodes) or self.policy


def _handler_in(callbacks: Any) -> KVRunHandler | None:
    """The :class:`KVRunHandler` among a config's callbacks (a list or a manager)."""
    if callbacks is None:
        return None
    handlers = callbacks if isinstance(callbacks, list) else getattr(callbacks, "handlers", [])
    return next((h for h in handlers if isinstance(h, KVRunHandler)), None)


def _current_run() -> tuple[GraphPolicy, RunContext] | None:
    """The wrapped run's policy and position for an API call made now, or None."""
    config = current_config()
    run = _MODEL_RUN.get()
    if run is not None and run[0] in _ACTIVE_RUNS:  # inside a chat-model run of a wrapped graph
        _, handler, ctx = run
        return handler.run_policy(config), ctx
    if not config:  # e.g. a raw OpenAI SDK call in a node's code
        return None
    handler = _handler_in(config.get("callbacks"))
    if handler is not None:
        return handler.run_policy(config), run_context(config)
    policy = effective_policy(None, config)  # e.g. JSON from a LangGraph server request
    if policy is None:
        return None
    return policy, run_context(config)


def _resolve(resource: Any) -> _openai.PayloadFactory | None:
    """Claim an OpenAI call made inside a wrapped run (instrumentation resolver)."""
    run = _current_run()
    if run is None:
        return None
    policy, ctx = run
    node_policy = policy_for_path(policy, ctx.path, ctx.node)

    def factory(messages: Sequence[Any]) -> Any:
        session = resolve_session_id(
            thread_id=ctx.thread_id, checkpoint_ns=ctx.graph_ns, messages=messages
        )
        return build_payload(messages, node_policy, session, node=ctx.node)

    return factory


def _without_handlers(runnable: Any) -> tuple[Any, KVRunHandler | None]:
    """``runnable`` with the KVRunHandler of an earlier wrap removed from its config
    callbacks, and that handler."""
    config = getattr(runnable, "config", None) or {}
    callbacks = config.get("callbacks")
    if not isinstance(callbacks, list):
        return runnable, None
    old = _handler_in(callbacks)
    if old is None:
        return runnable, None
    kept = [c for c in callbacks if not isinstance(c, KVRunHandler)]
    update = {"config": {**config, "callbacks": kept}}
    if isinstance(runnable, Pregel):
        return runnable.copy(update), old
    return runnable.model_copy(update=update), old


def _client_url(value: Any, depth: int = 3) -> str | None:
    """Base URL of a ``ChatOpenAI`` / OpenAI client, also inside bindings and sequences
    (``prompt | model.bind_tools(...)``), or None."""
    url = getattr(value, "openai_api_base", None)  # ChatOpenAI
    if url is None and hasattr(value, "chat") and hasattr(value, "base_url"):
        url = value.base_url  # openai.OpenAI / AsyncOpenAI
    if isinstance(url, str) or (url is not None and hasattr(url, "host")):
        return str(url)
    if depth and isinstance(value, Runnable):
        for inner in (getattr(value, "bound", None), *(getattr(value, "steps", None) or ())):
            found = _client_url(inner, depth - 1) if inner is not None else None
            if found:
                return found
    return None


def _server_urls(graph: Pregel) -> set[str]:
    """Base URLs of the OpenAI-compatible clients a graph's node functions refer to
    (``ChatOpenAI`` / ``openai.OpenAI`` objects, or runnables around them, among their
    globals and closure variables; best effort, for the wrap-time capabilities check)."""
    urls: set[str] = set()
    graphs = [graph, *(sub for _, sub in graph.get_subgraphs(recurse=True))]
    for g in graphs:
        for node in getattr(g, "nodes", {}).values():
            bound = getattr(node, "bound", None)
            for fn in (getattr(bound, "func", None), getattr(bound, "afunc", None)):
                fn = inspect.unwrap(fn) if callable(fn) else None
                if fn is None or not hasattr(fn, "__code__"):
                    continue
                try:
                    found = inspect.getclosurevars(fn)
                except (TypeError, ValueError):
                    continue
                for value in (*found.nonlocals.values(), *found.globals.values()):
                    url = _client_url(value)
                    if url:
                        urls.add(url)
    return urls


def with_kv_policy(
    graph: StateGraph | Pregel | Runnable,
    default: PolicyLike | GraphPolicy | None = None,
    nodes: Mapping[str, PolicyLike] | None = None,
    **compile_kwargs: Any,
) -> Pregel | Runnable:
    """``graph`` bound to a KV-cache policy: every chat-completions call made inside its
    nodes carries the agentkv payload (annotations, thread session id, node, node policy).

    ``graph``: a ``StateGraph`` (compiled here with ``compile_kwargs``, e.g.
    ``checkpointer=InMemorySaver()``) or a compiled graph. ``default``: policy for nodes
    without an override (default ``FullCache()``), or a whole ``GraphPolicy``. ``nodes``:
    per-node overrides; keys are node names of the graph or of a nested subgraph
    (``"search"``) or paths (``"research/search"``). Unknown keys raise
    :class:`agentkv.UnknownNodeError` here. Policies may be objects, wire dicts or spec
    strings (``"h2o:budget=32"``).

    A graph wrapped before is merged: these ``nodes`` replace or add to the earlier ones,
    and ``default`` replaces the earlier default when given. A policy given for one run
    (``configurable["agentkv"]``, ``context.agentkv``) is merged on top at run time.

    Wrap time, best effort: the servers that the nodes' ``ChatOpenAI`` / OpenAI clients point
    at are asked which methods they implement (``GET /v1/agentkv/capabilities``, cached per
    URL); a policy method they lack gives an :class:`agentkv.UnimplementedPolicyWarning`.
    An unreachable server gives no warning; the first request to each server checks again.

    Returns ``compiled.with_config(configurable={"agentkv": GraphPolicy}, callbacks=[...])``:
    a copy of the compiled graph (or of the given binding) whose runs carry the policy.
    """
    pregel, runnable = _compiled(graph, compile_kwargs)
    runnable, earlier = _without_handlers(runnable)
    if isinstance(runnable, Pregel):
        pregel = runnable
    policy = _graph_policy(default, nodes)
    if earlier is not None:
        policy = earlier.policy.merged(policy)
    known = graph_node_names(pregel)
    policy.check_nodes(known)
    _openai.add_resolver(_resolve)
    _openai.instrument()
    policies = [policy.default, *policy.nodes.values()]
    try:
        urls = _server_urls(pregel)
    except Exception:  # discovery is a convenience; never fail the wrap on it
        urls = set()
    for url in sorted(urls):
        _openai.check_server(url, policies, stacklevel=2)
    handler = KVRunHandler(policy, known)
    return runnable.with_config(configurable={CONFIG_KEY: policy}, callbacks=[handler])


_openai.add_resolver(_resolve)
