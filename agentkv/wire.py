"""Wire protocol v1: the agentkv payload that rides along with each chat-completions request.

Carried where both engines pass it through unchanged::

    extra_body={"custom_params": {"agentkv": "<JSON string of KVPayload>"}}

SGLang's OpenAI server types ``custom_params`` as a flat dict and drops unknown top-level
fields, so the payload travels as one JSON-encoded string value. ``python -m agentkv.wire``
prints the payload's JSON Schema (checked in as docs/wire-protocol-v1.schema.json).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentkv.annotation import MessageAnnotation, annotate_messages
from agentkv.policies import FullCache, KVPolicy, Policy

PROTOCOL_VERSION = 1
WIRE_KEY = "agentkv"
CUSTOM_PARAMS = "custom_params"


class PayloadError(ValueError):
    """A malformed agentkv payload. ``field`` names where (dotted path), if known."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class KVPayload(BaseModel):
    """One request's agentkv payload (protocol v1)."""

    model_config = ConfigDict(frozen=True, extra="forbid", title="agentkv wire payload v1")

    version: Literal[1] = PROTOCOL_VERSION
    session_id: str = Field(min_length=1, max_length=512)
    node: str | None = Field(None, description="graph node that made the call")
    policy: Policy = Field(default_factory=FullCache)
    messages: list[MessageAnnotation] | None = Field(
        None,
        description="one annotation per request message, same order; None: server derives them",
    )

    @field_validator("messages")
    @classmethod
    def _in_request_order(cls, v: list[MessageAnnotation] | None) -> list[MessageAnnotation] | None:
        for i, a in enumerate(v or ()):
            if a.index != i:
                raise ValueError(
                    f"messages[{i}].index is {a.index}; expected {i} "
                    "(one annotation per request message, in request order)"
                )
        return v


def build_payload(
    messages: Sequence[Any],
    policy: KVPolicy,
    session_id: str,
    node: str | None = None,
) -> KVPayload:
    """Annotate ``messages`` (OpenAI dicts or LangChain messages) into a payload."""
    return KVPayload(
        session_id=session_id,
        node=node,
        policy=policy,
        messages=annotate_messages(messages, node=node),
    )


def encode_payload(payload: KVPayload) -> str:
    """Compact JSON string for ``custom_params["agentkv"]``."""
    return payload.model_dump_json(exclude_none=False)


def decode_payload(raw: str | bytes | Mapping[str, Any]) -> KVPayload:
    """Parse a payload (JSON string or dict). Raises :class:`PayloadError` with the field."""
    if isinstance(raw, (str, bytes, bytearray)):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise PayloadError(
                f"agentkv payload is not valid JSON: {e.msg} at char {e.pos}"
            ) from None
        except (UnicodeDecodeError, RecursionError) as e:  # bad bytes, absurd nesting
            raise PayloadError(f"agentkv payload is not valid JSON: {e}") from None
    else:
        data = raw
    if not isinstance(data, Mapping):
        raise PayloadError(f"agentkv payload must be a JSON object, got {type(data).__name__}")
    version = data.get("version")
    # type check: True == 1 and 1.0 == 1 in Python, but neither is protocol version 1.
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise PayloadError(
            f"unsupported agentkv protocol version {version!r}; this engine speaks version "
            f"{PROTOCOL_VERSION}",
            field="version",
        )
    try:
        return KVPayload.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = _field_path(err["loc"], data)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise PayloadError(
            f"agentkv payload field {field!r}: {err['msg']}{more}", field=field
        ) from None


def _field_path(loc: Sequence[Any], data: Any) -> str:
    """Dotted path of a pydantic error location in the payload, without union tags.

    Pydantic puts the discriminator value into the location of errors inside a tagged union
    (``policy.intentkv.budget``); the payload itself has no such key (``policy.budget``).
    """
    out: list[str] = []
    cur = data
    for i, seg in enumerate(loc):
        if (
            isinstance(cur, Mapping)
            and isinstance(seg, str)
            and cur.get("method") == seg
            and (i + 1 < len(loc) or seg not in cur)
        ):
            continue
        out.append(str(seg))
        if isinstance(cur, Mapping):
            cur = cur.get(seg)
        elif isinstance(cur, list) and isinstance(seg, int) and 0 <= seg < len(cur):
            cur = cur[seg]
        else:
            cur = None
    return ".".join(out)


def to_extra_body(
    payload: KVPayload, extra_body: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge the payload into an OpenAI SDK ``extra_body`` (keeps other custom_params)."""
    body = dict(extra_body or {})
    params = dict(body.get(CUSTOM_PARAMS) or {})
    params[WIRE_KEY] = encode_payload(payload)
    body[CUSTOM_PARAMS] = params
    return body


def payload_from_request(body: Mapping[str, Any]) -> KVPayload | None:
    """The payload of a chat-completions request body, or None when it carries none."""
    params = body.get(CUSTOM_PARAMS)
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise PayloadError("custom_params must be an object", field=CUSTOM_PARAMS)
    raw = params.get(WIRE_KEY)
    if raw is None:
        return None
    return decode_payload(raw)


def json_schema() -> dict[str, Any]:
    """JSON Schema of :class:`KVPayload` (the value inside the JSON string)."""
    schema = KVPayload.model_json_schema()
    schema["required"] = sorted({*schema.get("required", []), "version"})
    schema["$id"] = "agentkv:wire-protocol-v1"
    return schema


SCHEMA_PATH = "docs/wire-protocol-v1.schema.json"


def write_schema(path: str = SCHEMA_PATH) -> None:
    """Write :func:`json_schema` to ``path`` (the checked-in copy under docs/)."""
    with open(path, "w") as f:
        json.dump(json_schema(), f, indent=2, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":  # python -m agentkv.wire  ->  the JSON Schema on stdout
    print(json.dumps(json_schema(), indent=2, sort_keys=True))
