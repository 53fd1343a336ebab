"""Shared fixtures: one embedded engine on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine():
    """The real engine on the default model, CPU, small pool; shared by every test that asks.

    Tests must use their own session ids (and may call ``engine.end_session``) so they do not
    depend on each other's prefix-cache state.
    """
    pytest.importorskip("torch")
    from agentkv.engine.engine import Engine

    return Engine(device="cpu", kv_slots=16384, chunk_size=256)


@pytest.fixture(scope="session")
def server(engine):
    """The engine served over HTTP on 127.0.0.1 (random port); yields the BackgroundServer."""
    from agentkv.engine.server import BackgroundServer

    with BackgroundServer(engine) as srv:
        yield srv
