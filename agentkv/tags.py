"""Tag taxonomy: three axes per token, packed into one small integer (a `TagCode`).

Axes (TriAxialKV): semantic role, modality, temporal bucket. A packed code fits in 6 bits::

    code = role | modality << 3 | temporal << 4        # 0 <= code < 64

so a per-token tag tensor can be ``uint8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator, WithJsonSchema


class Role(IntEnum):
    """Semantic role of a token."""

    INST = 0  # system prompt and tool schemas
    USER = 1
    ASSISTANT = 2
    REASONING = 3  # <think> ... </think>, reasoning content blocks
    TOOL_CALL = 4  # assistant tool calls (name + arguments)
    OBS = 5  # tool results, screenshots
    DELIM = 6  # chat-template scaffolding: role markers, message delimiters


class Modality(IntEnum):
    TEXT = 0
    IMAGE = 1


class Temporal(IntEnum):
    """Age of a token relative to the request's current turn."""

    CURRENT = 0
    TURN_M1 = 1
    TURN_M2 = 2
    OLDER = 3

    @classmethod
    def from_age(cls, age: int) -> Temporal:
        """Bucket for a message ``age`` turns before the current one (``age >= 0``)."""
        if age < 0:
            raise ValueError(f"turn age must be >= 0, got {age}")
        return cls(min(age, 3))


_ROLE_BITS = 3
_MODALITY_BITS = 1
_MODALITY_SHIFT = _ROLE_BITS
_TEMPORAL_SHIFT = _ROLE_BITS + _MODALITY_BITS
NUM_TAG_CODES = 1 << (_TEMPORAL_SHIFT + 2)


@dataclass(frozen=True, slots=True)
class Tag:
    """One token's tag, unpacked."""

    role: Role
    modality: Modality = Modality.TEXT
    temporal: Temporal = Temporal.CURRENT

    @property
    def code(self) -> int:
        return TagCode.pack(self.role, self.modality, self.temporal)

    @property
    def name(self) -> str:
        """Readable name, e.g. ``obs/text/turn_m1``."""
        return f"{self.role.name.lower()}/{self.modality.name.lower()}/{self.temporal.name.lower()}"


class TagCode:
    """Pack and unpack per-token tag codes (ints in ``[0, NUM_TAG_CODES)``)."""

    @staticmethod
    def pack(
        role: Role, modality: Modality = Modality.TEXT, temporal: Temporal = Temporal.CURRENT
    ) -> int:
        # Enum conversion rejects out-of-range values that would spill into the next axis's bits.
        return (
            int(Role(role))
            | int(Modality(modality)) << _MODALITY_SHIFT
            | int(Temporal(temporal)) << _TEMPORAL_SHIFT
        )

    @staticmethod
    def unpack(code: int) -> Tag:
        if not 0 <= code < NUM_TAG_CODES:
            raise ValueError(f"tag code must be in [0, {NUM_TAG_CODES}), got {code}")
        return Tag(
            role=Role(code & ((1 << _ROLE_BITS) - 1)),
            modality=Modality((code >> _MODALITY_SHIFT) & 1),
            temporal=Temporal(code >> _TEMPORAL_SHIFT),
        )

    @staticmethod
    def role_of(code: int) -> Role:
        return Role(code & ((1 << _ROLE_BITS) - 1))

    @staticmethod
    def with_temporal(code: int, temporal: Temporal) -> int:
        """The same tag moved to another temporal bucket."""
        return (code & ((1 << _TEMPORAL_SHIFT) - 1)) | int(temporal) << _TEMPORAL_SHIFT

    @staticmethod
    def name(code: int) -> str:
        return TagCode.unpack(code).name


def _enum_by_name(enum: type[IntEnum]) -> Any:
    """Annotated type: an IntEnum that travels on the wire as its lower-case name."""

    def parse(value: Any) -> IntEnum:
        if isinstance(value, enum):
            return value
        if isinstance(value, str):
            try:
                return enum[value.upper()]
            except KeyError:
                names = [m.name.lower() for m in enum]
                raise ValueError(
                    f"unknown {enum.__name__.lower()} {value!r}; expected one of {names}"
                ) from None
        raise ValueError(f"{enum.__name__.lower()} must be a name string, got {value!r}")

    return Annotated[
        enum,
        PlainValidator(parse),
        PlainSerializer(lambda m: m.name.lower(), return_type=str),
        WithJsonSchema({"type": "string", "enum": [m.name.lower() for m in enum]}),
    ]


#: Wire types: enums serialised by name ("obs", "image", "turn_m1").
RoleName = _enum_by_name(Role)
ModalityName = _enum_by_name(Modality)
TemporalName = _enum_by_name(Temporal)
