"""What an agentkv server implements (``GET /v1/agentkv/capabilities``), asked once per URL.

Policies are validated client-side for every method agentkv defines, but a server implements
only some of them and answers the others with HTTP 400. :func:`warn_unimplemented` lets the
integrations warn when a graph or client is wrapped (and before the first request), instead
of leaving the user to find the 400 later. It never fails: a server that cannot be reached,
or that is not an agentkv engine (an SGLang / vLLM server, a proxy), gives no warning.

Standard library only (``urllib``): the client side needs no HTTP dependency for this.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from agentkv.policies import KVPolicy

__all__ = [
    "CAPABILITIES_PATH",
    "DecodePath",
    "ServerCapabilities",
    "UnimplementedPolicyWarning",
    "capabilities_url",
    "clear_capabilities_cache",
    "fetch_capabilities",
    "warn_unimplemented",
]

CAPABILITIES_PATH = "/v1/agentkv/capabilities"
#: Seconds an answer (or a failure to get one) is reused for a base URL.
CACHE_TTL_S = 300.0
FAILURE_TTL_S = 30.0


class UnimplementedPolicyWarning(UserWarning):
    """A policy names a method the server does not implement (it will answer HTTP 400)."""


class DecodePath(BaseModel):
    """How the server decodes (the embedded engine's ``decode`` answer)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: ``"kernels"`` (the fused kernels over the pools), ``"dense"`` or ``"reference"``
    attention: str
    #: decode steps replayed from a CUDA graph now
    cuda_graphs: bool = False
    #: why a capture failed (decode fell back to eager steps), or None
    graph_failure: str | None = None
    #: each step launched before the server reads the token it feeds (host and GPU overlap)
    steps_ahead: bool = False
    #: the model's ops run as agentkv's kernels (``"norms"``, ``"projections"``,
    #: ``"rotary"``) instead of transformers' own: small numeric differences come from here
    fused_ops: list[str] = []


class ServerCapabilities(BaseModel):
    """The answer of ``GET /v1/agentkv/capabilities``."""

    model_config = ConfigDict(extra="allow", frozen=True)

    protocol_version: int
    #: policy methods the engine implements (wire names: ``"full"``, ``"intentkv"``, ...).
    methods: list[str]
    model: str | None = None
    #: how it decodes (None: not said, e.g. an older server)
    decode: DecodePath | None = None


_LOCK = threading.Lock()
_CACHE: dict[str, tuple[float, ServerCapabilities | None]] = {}


def capabilities_url(base_url: str) -> str:
    """``http://host:port/v1`` (an OpenAI ``base_url``) or ``http://host:port`` -> the
    capabilities endpoint."""
    base = str(base_url).rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + CAPABILITIES_PATH


def clear_capabilities_cache() -> None:
    """Forget every cached answer (the next check asks the server again)."""
    with _LOCK:
        _CACHE.clear()


def fetch_capabilities(
    base_url: str, *, api_key: str | None = None, timeout: float = 2.0
) -> ServerCapabilities | None:
    """The server's capabilities, or None when it cannot say (unreachable, not an agentkv
    engine, an error). Cached per URL: answers for :data:`CACHE_TTL_S` seconds, failures for
    :data:`FAILURE_TTL_S`."""
    url = capabilities_url(base_url)
    now = time.monotonic()
    with _LOCK:
        hit = _CACHE.get(url)
    if hit is not None and now < hit[0]:
        return hit[1]
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    caps: ServerCapabilities | None = None
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=timeout
        ) as r:
            caps = ServerCapabilities.model_validate(json.loads(r.read()))
    except (OSError, ValueError, ValidationError, urllib.error.URLError):
        caps = None
    with _LOCK:
        _CACHE[url] = (now + (CACHE_TTL_S if caps is not None else FAILURE_TTL_S), caps)
    return caps


def _methods(policies: Iterable[KVPolicy | Any]) -> list[str]:
    out: list[str] = []
    for p in policies:
        method = getattr(p, "method", None)
        if isinstance(method, str) and method not in out:
            out.append(method)
    return out


def warn_unimplemented(
    base_url: str,
    policies: Iterable[KVPolicy],
    *,
    api_key: str | None = None,
    stacklevel: int = 2,
) -> list[str]:
    """Warn (:class:`UnimplementedPolicyWarning`) when the server at ``base_url`` does not
    implement the method of one of ``policies``; returns those methods (``[]`` when all are
    implemented or the server cannot say). Never raises for an unreachable server."""
    caps = fetch_capabilities(base_url, api_key=api_key)
    if caps is None:
        return []
    missing = [m for m in _methods(policies) if m not in caps.methods]
    if missing:
        warnings.warn(
            f"agentkv: the server at {base_url} does not implement "
            f"{', '.join(repr(m) for m in missing)} (it implements "
            f"{', '.join(caps.methods)}); requests with "
            f"{'this policy' if len(missing) == 1 else 'these policies'} will be answered "
            "with HTTP 400",
            UnimplementedPolicyWarning,
            stacklevel=stacklevel + 1,
        )
    return missing
