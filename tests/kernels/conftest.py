"""Fixtures for the kernel tests.

No ``__init__.py`` here on purpose: a test package named ``kernels`` would shadow the
PyPI ``kernels`` package (see DESIGN.md).
"""

from __future__ import annotations

import os

import pytest
import torch

# CPU runs go through the Triton interpreter (the Makefile sets it; this covers plain pytest).
# It must be set before the kernels are defined, i.e. before agentkv.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mixed_batch import DEVICE, build_mixed_batch  # noqa: E402


@pytest.fixture
def mixed_batch():  # type: ignore[no-untyped-def]
    """Factory fixture: ``mixed_batch(lens, hq=.., hkv=.., d=.., ...) -> MixedBatch``."""
    return build_mixed_batch


@pytest.fixture
def device() -> torch.device:
    return DEVICE
