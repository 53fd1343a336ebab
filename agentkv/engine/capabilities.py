"""``GET /v1/agentkv/capabilities``: what this engine implements.

Clients validate every policy method agentkv defines, but the engine implements only the
methods registered in :mod:`agentkv.methods`; the others are answered with HTTP 400. The
integrations ask this route when a graph or client is wrapped
(:func:`agentkv.warn_unimplemented`) and warn about the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.methods import registered_methods
from agentkv.wire import PROTOCOL_VERSION

if TYPE_CHECKING:  # (the route's app; capabilities() itself needs no server packages)
    from fastapi import FastAPI

CAPABILITIES_ROUTE = "/v1/agentkv/capabilities"


def capabilities(engine: Any) -> dict[str, Any]:
    """The wire protocol version, the policy methods the engine implements (wire names,
    sorted), the model name and how it decodes: ``decode.attention`` (``kernels`` /
    ``dense`` / ``reference``), ``decode.cuda_graphs`` (steps replayed from a CUDA graph now),
    ``decode.graph_failure`` (why a capture failed, leaving decode eager; else null),
    ``decode.steps_ahead`` (each step launched before the host reads the token it feeds)
    and ``decode.fused_ops`` (the model's ops running as agentkv's kernels instead of
    transformers' own: ``norms``, ``projections``, ``rotary``)."""
    from agentkv.engine.model_loader import fused_ops

    graph = getattr(engine, "decode_graph", None)
    failure = None if graph is None else graph.failed
    return {
        "protocol_version": PROTOCOL_VERSION,
        "methods": sorted(registered_methods()),
        "model": engine.model_name,
        "decode": {
            "attention": engine.decode_attention,
            "cuda_graphs": graph is not None and failure is None,
            "graph_failure": failure,
            "steps_ahead": graph is not None and engine.decode_overlap,
            "fused_ops": fused_ops(engine.model),
        },
    }


def add_capabilities_route(app: FastAPI, engine: Any) -> None:
    """Serve :func:`capabilities` at ``GET /v1/agentkv/capabilities``."""

    @app.get(CAPABILITIES_ROUTE)
    def get_capabilities() -> dict[str, Any]:
        return capabilities(engine)
