"""Choice between the Triton kernels and their pure-torch references.

``backend="auto"`` picks Triton when the tensors are on CUDA, or when the Triton
interpreter is on (``TRITON_INTERPRET=1``, CPU tests); otherwise torch. Triton is
imported lazily so that this package imports on machines without it.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]


def triton_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache  # (an import attempt on every kernel call's hot path otherwise)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """Resolve ``backend`` for tensors on ``device``; raises if Triton cannot run there."""
    if backend == "torch":
        return "torch"
    usable = triton_available() and (device.type == "cuda" or triton_interpreting())
    if backend == "triton":
        if not usable:
            raise RuntimeError(
                "backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (and triton installed)"
            )
        return "triton"
    if backend != "auto":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    return "triton" if usable else "torch"
