"""The store tests run many tiny tensor ops: one intra-op thread is several times faster for
them than torch's default (and kinder to a shared machine). Restored after each test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
