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
  namespace of the graph running the node (the nodes of one graph share the thread's
  session ``lg:<thread>``; a subgraph's nodes get ``lg:<thread>/<subgraph node>``); without
  a thread id, a hash of the conversation's opening.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.runnables import Runnable, RunnableBinding
from langgraph.graph.state import StateGraph
from langgraph.pregel import Pregel

from agentkv.policies import GraphPolicy, KVPolicy
from agentkv.session import resolve_session_id
from agentkv.wire import build_payload

from . import openai as _openai
from .run_context import (
    PolicyLike,
    RunContext,
    coerce_policy,
    current_config,
    metadata_run_context,
    run_context,
)

__all__ = ["CONFIG_KEY", "KVRunHandler", "graph_node_names", "policy_for_path", "with_kv_policy"]

#: ``configurable`` key that carries the :class:`~agentkv.GraphPolicy` of a wrapped run.
CONFIG_KEY = "agentkv"


def _compiled(graph: Any, compile_kwargs: Mapping[str, Any]) -> tuple[Pregel, Runnable]:
    """(the Pregel graph to inspect, the runnable to bind)."""
    if isinstance(graph, StateGraph):
        compiled = graph.compile(**compile_kwargs)
        return compiled, compiled
    if compile_kwargs:
        raise TypeError(
            f"compile arguments {sorted(compile_kwargs)} only apply to an uncompiled StateGraph"
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


def _graph_policy(default: Any, nodes: Mapping[str, PolicyLike] | None) -> GraphPolicy:
    if isinstance(default, GraphPolicy):
        if nodes:
            raise TypeError("pass either a GraphPolicy or default= and nodes=, not both")
        return default
    return GraphPolicy(
        default=coerce_policy(default),
        nodes={name: coerce_policy(p) for name, p in (nodes or {}).items()},
    )


#: The chat-model run in progress in this context: (run id, graph policy, where it runs).
_MODEL_RUN: ContextVar[tuple[UUID, GraphPolicy, RunContext] | None] = ContextVar(
    "agentkv_model_run", default=None
)
#: Chat-model runs started and not yet ended (a stale ``_MODEL_RUN`` value is ignored).
_ACTIVE_RUNS: set[UUID] = set()


class KVRunHandler(BaseCallbackHandler):
    """Callback handler that ``with_kv_policy`` adds to the wrapped graph's ``callbacks``.

    On ``on_chat_model_start`` it records the graph policy and LangGraph's run metadata
    (``langgraph_node``, ``langgraph_checkpoint_ns``, ``thread_id``) in a ``ContextVar``.
    ``run_inline`` makes LangChain call it in the model's own thread / asyncio task, right
    before the model calls the API, so the instrumented ``create`` sees the value. This path
    does not depend on LangGraph setting the current config for async nodes, which it cannot
    do before Python 3.11.
    """

    run_inline = True

    def __init__(self, policy: GraphPolicy) -> None:
        super().__init__()
        self.policy = policy

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        _ACTIVE_RUNS.add(run_id)
        _MODEL_RUN.set((run_id, self.policy, metadata_run_context(metadata)))

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        _ACTIVE_RUNS.discard(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        _ACTIVE_RUNS.discard(run_id)


def _current_run() -> tuple[GraphPolicy, RunContext] | None:
    """The wrapped run's policy and position for an API call made now, or None."""
    run = _MODEL_RUN.get()
    if run is not None and run[0] in _ACTIVE_RUNS:  # inside a chat-model run of a wrapped graph
        return run[1], run[2]
    config = current_config()  # e.g. a raw OpenAI SDK call in a node's code
    if not config:
        return None
    policy = (config.get("configurable") or {}).get(CONFIG_KEY)
    if policy is None:
        return None
    if not isinstance(policy, GraphPolicy):  # e.g. JSON from a LangGraph server request
        policy = GraphPolicy.model_validate(policy)
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
    :class:`agentkv.UnknownNodeError` here. Policies may be objects, wire dicts or CLI specs.

    Returns ``compiled.with_config(configurable={"agentkv": GraphPolicy})``: a copy of the
    compiled graph (or of the given binding) whose runs carry the policy.
    """
    policy = _graph_policy(default, nodes)
    pregel, runnable = _compiled(graph, compile_kwargs)
    policy.check_nodes(graph_node_names(pregel))
    _openai.add_resolver(_resolve)
    _openai.instrument()
    return runnable.with_config(configurable={CONFIG_KEY: policy}, callbacks=[KVRunHandler(policy)])


_openai.add_resolver(_resolve)
