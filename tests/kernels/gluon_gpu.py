"""What the Gluon decode splits' GPU tests share: whether this machine runs Gluon kernels,
the skip mark for the tests that need one, and the relative error they assert on."""

from __future__ import annotations

import pytest
import torch

from agentkv.kernels.gluon_fragments import GLUON_AVAILABLE, MIN_CAPABILITY

CUDA = torch.device("cuda")
GLUON_GPU = (
    GLUON_AVAILABLE
    and torch.cuda.is_available()
    and torch.cuda.get_device_capability() >= MIN_CAPABILITY
)
#: skips a test unless a CUDA GPU of compute capability >= 8.0 and a Triton with Gluon are here
needs_gluon_gpu = pytest.mark.skipif(
    not GLUON_GPU, reason="the Gluon decode splits need a CUDA GPU of compute capability >= 8.0"
)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in float32."""
    return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))
