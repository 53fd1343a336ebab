"""Fixtures of the engine and server tests: the shared real engine (``engine``, ``server``
from ``tests/conftest.py``), the plain-transformers reference model and HTTP clients."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="package")
def hf_model() -> Any:
    """Plain transformers (SDPA attention) on the same weights as the engine, float32, CPU."""
    from transformers import AutoModelForCausalLM

    from agentkv.engine.model_loader import resolve_model_dir

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(None), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


@pytest.fixture
def sid(request: pytest.FixtureRequest) -> str:
    """A session id no other test uses."""
    return f"{uuid.uuid4().hex[:8]}-{request.node.name[:40]}"


@pytest.fixture
def client(server: Any) -> Iterator[Any]:
    """The real OpenAI SDK client on the engine's server."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(server: Any) -> Iterator[Any]:
    """A raw HTTP client on the server root (for malformed requests and agentkv endpoints)."""
    httpx = pytest.importorskip("httpx")
    root = server.base_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=120) as c:
        yield c
