"""agentkv: agent-aware KV-cache policies.

The client side (this package's top level and ``agentkv.integrations.{langgraph,langchain,
openai}``) imports without torch, triton or transformers.
"""

from agentkv.annotation import MessageAnnotation, MessagePart, annotate_messages
from agentkv.kv_usage import aggregate_by_node, usage
from agentkv.policies import (
    ARKV,
    H2O,
    FullCache,
    GraphPolicy,
    IntentKV,
    KVPolicy,
    KVzap,
    SnapKV,
    StreamingLLM,
    TriAxialKV,
    UniformQuant,
    UnknownNodeError,
    parse_policy,
    parse_policy_spec,
)
from agentkv.server_capabilities import (
    ServerCapabilities,
    UnimplementedPolicyWarning,
    fetch_capabilities,
    warn_unimplemented,
)
from agentkv.session import resolve_session_id
from agentkv.tags import Modality, Role, Tag, TagCode, Temporal
from agentkv.wire import (
    PROTOCOL_VERSION,
    KVPayload,
    PayloadError,
    build_payload,
    decode_payload,
    encode_payload,
    payload_from_request,
    to_extra_body,
)

__version__ = "0.1.0"

__all__ = [
    "ARKV",
    "H2O",
    "PROTOCOL_VERSION",
    "FullCache",
    "GraphPolicy",
    "IntentKV",
    "KVPayload",
    "KVPolicy",
    "KVzap",
    "MessageAnnotation",
    "MessagePart",
    "Modality",
    "PayloadError",
    "Role",
    "ServerCapabilities",
    "SnapKV",
    "StreamingLLM",
    "Tag",
    "TagCode",
    "Temporal",
    "TriAxialKV",
    "UniformQuant",
    "UnimplementedPolicyWarning",
    "UnknownNodeError",
    "aggregate_by_node",
    "annotate_messages",
    "build_payload",
    "decode_payload",
    "encode_payload",
    "fetch_capabilities",
    "parse_policy",
    "parse_policy_spec",
    "payload_from_request",
    "resolve_session_id",
    "to_extra_body",
    "usage",
    "warn_unimplemented",
]
