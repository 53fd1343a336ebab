"""KV-cache methods: one module per method, scoring and planning only (no storage).

Importing this package registers every implementation with :mod:`agentkv.methods.base`.
"""

from agentkv.methods import full_cache, h2o, intentkv, kvzap, snapkv, streaming_llm  # noqa: F401
from agentkv.methods.base import (
    DecodeContext,
    Method,
    MethodSet,
    ModelShape,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
    method_class,
    registered_methods,
)

__all__ = [
    "DecodeContext",
    "Method",
    "MethodSet",
    "ModelShape",
    "ObserveRequest",
    "Plan",
    "PlanContext",
    "PrefillObserver",
    "method_class",
    "registered_methods",
]
