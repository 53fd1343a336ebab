"""KV-cache methods: one module per method, scoring and planning only (no storage).

Importing this package registers every implementation with :mod:`agentkv.methods.base`.
"""

from agentkv.methods import (  # noqa: F401
    full_cache,
    h2o,
    intentkv,
    kvzap,
    snapkv,
    streaming_llm,
    uniform_quant,
)
from agentkv.methods.base import (
    DecodeContext,
    DecodePrecision,
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
    "DecodePrecision",
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
