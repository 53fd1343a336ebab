"""Helpers shared by the client-side integrations (no torch, no triton, no transformers).

``run_context`` reads the LangChain runnable config that LangGraph sets for the node being
run (``langchain_core.runnables.config.var_child_runnable_config``, a ``ContextVar``; it is
what ``langgraph.config.get_config()`` returns); ``metadata_run_context`` reads the same
facts from a run's metadata as callbacks receive it. Inside a node LangGraph puts:

- ``metadata["langgraph_node"]``: the node's name (the innermost node in a subgraph);
- ``configurable["checkpoint_ns"]`` (also ``metadata["langgraph_checkpoint_ns"]``): the task's
  checkpoint namespace, ``"outer:<task id>|inner:<task id>"``;
- ``configurable["thread_id"]``: the thread, inherited by subgraphs (copied to
  ``metadata["thread_id"]``).

Because the value lives in a ``ContextVar`` (copied into LangGraph's worker threads and
asyncio tasks), two concurrent runs never see each other's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentkv.policies import FullCache, KVPolicy, parse_policy, parse_policy_spec
from agentkv.wire import CUSTOM_PARAMS, WIRE_KEY

PolicyLike = KVPolicy | Mapping[str, Any] | str


def coerce_policy(policy: PolicyLike | None) -> KVPolicy:
    """A policy from a policy object, its wire dict, or a CLI spec (``"intentkv:budget=512"``)."""
    if policy is None:
        return FullCache()
    if isinstance(policy, str):
        return parse_policy_spec(policy)
    return parse_policy(policy)


def has_payload(extra_body: Any) -> bool:
    """True when an ``extra_body`` already carries ``custom_params["agentkv"]``."""
    if not isinstance(extra_body, Mapping):
        return False
    params = extra_body.get(CUSTOM_PARAMS)
    return isinstance(params, Mapping) and params.get(WIRE_KEY) is not None


@dataclass(frozen=True)
class RunContext:
    """Where a model call happens inside a LangGraph run (all empty outside one)."""

    node: str | None = None
    #: node path, outermost first: ``("research", "search")`` for node ``search`` of the
    #: subgraph run by node ``research``.
    path: tuple[str, ...] = ()
    thread_id: str | None = None
    #: checkpoint namespace of the graph that runs the node (``""`` for the root graph):
    #: the task namespace minus its last segment. Nodes of one graph share it.
    graph_ns: str = ""


def current_config() -> Mapping[str, Any] | None:
    """The runnable config of the current LangChain/LangGraph run, or None outside one."""
    try:
        from langchain_core.runnables.config import var_child_runnable_config
    except ImportError:  # the OpenAI integration works without LangChain installed
        return None
    return var_child_runnable_config.get()


def make_run_context(
    checkpoint_ns: str | None, node: str | None = None, thread_id: Any = None
) -> RunContext:
    """A :class:`RunContext` from a task checkpoint namespace, node name and thread id."""
    segments = [s for s in str(checkpoint_ns or "").split("|") if s]
    path = tuple(s.split(":", 1)[0] for s in segments)
    return RunContext(
        node=node or (path[-1] if path else None),
        path=path,
        thread_id=None if thread_id is None else str(thread_id),
        graph_ns="|".join(segments[:-1]),
    )


def run_context(config: Mapping[str, Any] | None = None) -> RunContext:
    """The :class:`RunContext` of ``config`` (default: the current runnable config)."""
    if config is None:
        config = current_config()
    if not config:
        return RunContext()
    conf = config.get("configurable") or {}
    meta = config.get("metadata") or {}
    return make_run_context(
        conf.get("checkpoint_ns") or meta.get("langgraph_checkpoint_ns"),
        meta.get("langgraph_node"),
        conf.get("thread_id"),
    )


def metadata_run_context(metadata: Mapping[str, Any] | None) -> RunContext:
    """The :class:`RunContext` of a run's metadata as callbacks see it: LangGraph puts
    ``langgraph_node`` and ``langgraph_checkpoint_ns`` there and copies ``thread_id`` from
    ``configurable``."""
    meta = metadata or {}
    return make_run_context(
        meta.get("langgraph_checkpoint_ns") or meta.get("checkpoint_ns"),
        meta.get("langgraph_node"),
        meta.get("thread_id"),
    )
