"""KV-cache policies: immutable, validated pydantic models, one per method.

Every knob comes from ../shared/methods/NOTES.md with its default. Out-of-range values raise
``pydantic.ValidationError`` whose message names the field and its allowed range, e.g.::

    IntentKV(budget=0)  ->  budget: must be in [1, 1048576], got 0

A :class:`GraphPolicy` is a default policy plus per-node overrides.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, Union

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

MAX_BUDGET = 1 << 20  # tokens
_BOUND_ERRORS = {"greater_than_equal", "greater_than", "less_than_equal", "less_than"}


def _read_only(value: Any) -> Any:
    """Frozen models keep their dict fields read-only too (``MappingProxyType``)."""
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else value


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


#: annotations: ``dict`` on the wire and in the schema, read-only once validated.
_READ_ONLY = AfterValidator(_read_only)
_AS_DICT = PlainSerializer(_plain)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _bounds(field: Any) -> tuple[float, float, bool, bool]:
    """(low, high, low_inclusive, high_inclusive) from a field's annotated-types metadata."""
    lo, hi, lo_inc, hi_inc = -math.inf, math.inf, True, True
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            lo, lo_inc = m.ge, True
        elif isinstance(m, annotated_types.Gt):
            lo, lo_inc = m.gt, False
        elif isinstance(m, annotated_types.Le):
            hi, hi_inc = m.le, True
        elif isinstance(m, annotated_types.Lt):
            hi, hi_inc = m.lt, False
    return lo, hi, lo_inc, hi_inc


class KVPolicy(BaseModel):
    """Base of all policies. ``method`` is the wire discriminator."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    method: str

    #: True when the policy may evict tokens (drives telemetry and tests).
    evicts: ClassVar[bool] = False
    #: True when the policy may quantize tokens.
    quantizes: ClassVar[bool] = False

    def __init__(self, /, *args: Any, **data: Any) -> None:
        """Positional arguments fill the fields in the order they are declared, ``method``
        excluded: ``IntentKV(512)`` is ``IntentKV(budget=512)``."""
        if args:
            names = [n for n in type(self).model_fields if n != "method"]
            if len(args) > len(names):
                raise TypeError(
                    f"{type(self).__name__}() takes at most {len(names)} positional "
                    f"argument(s) ({', '.join(names) or 'none'}), got {len(args)}"
                )
            for name, value in zip(names, args, strict=False):
                if name in data:
                    raise TypeError(f"{type(self).__name__}() got multiple values for {name!r}")
                data[name] = value
        super().__init__(**data)

    @model_validator(mode="wrap")
    @classmethod
    def _range_message(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """Rewrite pydantic's bound errors as "field: must be in [lo, hi], got v"."""
        try:
            return handler(data)
        except ValidationError as e:
            errors: list[Any] = []
            changed = False
            for err in e.errors():
                name = err["loc"][0] if err["loc"] else None
                if err["type"] in _BOUND_ERRORS and name in cls.model_fields:
                    lo, hi, lo_inc, hi_inc = _bounds(cls.model_fields[name])
                    rng = f"{'[' if lo_inc else '('}{_num(lo)}, {_num(hi)}{']' if hi_inc else ')'}"
                    err = {
                        "type": PydanticCustomError(
                            "out_of_range",
                            "{field}: must be in {range}, got {value}",
                            {"field": name, "range": rng, "value": err["input"]},
                        ),
                        "loc": err["loc"],
                        "input": err["input"],
                    }
                    changed = True
                else:
                    err = {k: err[k] for k in ("type", "loc", "input", "ctx") if k in err}
                errors.append(err)
            if not changed:
                raise
            raise ValidationError.from_exception_data(cls.__name__, errors) from None

    def describe(self) -> str:
        """Short label, e.g. ``intentkv(budget=512)``."""
        fields = {k: v for k, v in self.model_dump().items() if k != "method"}
        defaults = {k: f.default for k, f in type(self).model_fields.items()}
        shown = [f"{k}={v}" for k, v in fields.items() if defaults.get(k) != v or k == "budget"]
        return f"{self.method}({', '.join(shown)})"


Budget = Annotated[int, Field(ge=1, le=MAX_BUDGET, description="live KV tokens kept (tokens)")]


class FullCache(KVPolicy):
    """No compression: every token kept at full precision."""

    method: Literal["full"] = "full"


class IntentKV(KVPolicy):
    """IntentKV: session QueryMemory + rule score over the live history.

    ``budget_scope="total"`` (the paper's "residual budget", the default): the request keeps at
    most ``max(budget, |forced|)`` live tokens, the forced set first and the remainder by
    score, so it compares with every other compressor at equal live KV. ``"history"``: the
    forced set rides on top of ``budget`` history tokens (the earlier reading).
    """

    method: Literal["intentkv"] = "intentkv"
    evicts: ClassVar[bool] = True
    budget: Budget = 2048
    budget_scope: Literal["total", "history"] = Field(
        "total",
        description="'total': live KV <= max(budget, forced); 'history': forced + budget",
    )
    memory_decay: float = Field(0.5, ge=0.0, lt=1.0, description="beta of the QueryMemory EMA")
    mode: Literal["memory", "query", "learned"] = Field(
        "memory",
        description="'memory' scores with the session memory m, 'query' with normalize(q-bar), "
        "'learned' adds the trained residual head (Phase-2) to the memory score",
    )
    protect_system: bool = Field(True, description="force-keep the system/template prefix")
    fallback_window: int = Field(
        32,
        ge=1,
        le=4096,
        description="with no actionable token computed, q-bar averages the last N positions",
    )
    alpha_max: float | None = Field(
        None,
        ge=0.0,
        le=100.0,
        description="mode 'learned': the residual's alpha clipped to [0, this]; None: the value "
        "calibrated into the head's checkpoint (1.0 for a head without one)",
    )
    ablate: Literal["memory", "cross_attention", "rule"] | None = Field(
        None,
        description="mode 'learned' only, the paper's ablations: 'memory' feeds the head and the "
        "rule normalize(q-bar) instead of the session memory, 'cross_attention' zeroes the "
        "head's readout c, 'rule' ranks by the residual alone (head only); None: full Phase-2",
    )

    @field_validator("ablate")
    @classmethod
    def _ablate_needs_learned(cls, v: str | None, info: ValidationInfo) -> str | None:
        mode = info.data.get("mode")
        if v is not None and mode != "learned":
            raise ValueError(f"ablate={v!r} ablates the learned head: it needs mode='learned'")
        return v


class TriAxialKV(KVPolicy):
    """TriAxialKV: per-tag INT2/INT4 allocation under an average bit budget."""

    method: Literal["triaxialkv"] = "triaxialkv"
    quantizes: ClassVar[bool] = True
    avg_bits: float = Field(3.0, ge=2.0, le=4.0, description="average KV bits per element")
    group_size: Literal[32] = 32
    page_size: Literal[32] = 32
    allocation: Annotated[dict[str, Literal[2, 4]] | None, _READ_ONLY, _AS_DICT] = Field(
        None,
        description="calibrated bits per tag name (e.g. 'obs/text/older': 2); None = calibrate",
    )


class KVzap(KVPolicy):
    """KVzap: learned per-head surrogate score, prune below a threshold, keep a recent window."""

    method: Literal["kvzap"] = "kvzap"
    evicts: ClassVar[bool] = True
    threshold: float = Field(-4.0, ge=-20.0, le=5.0, description="tau on predicted log-score")
    window: int = Field(128, ge=0, le=MAX_BUDGET, description="recent tokens always kept")
    surrogate: Literal["mlp", "linear"] = "mlp"
    surrogate_path: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        pattern=r"^[^\x00-\x1f]+$",
        description="server-side folder from `agentkv train-kvzap --out DIR` (for models "
        "without a shipped surrogate); None = the surrogate shipped for the default model",
    )
    decode_interval: int = Field(
        16,
        ge=0,
        le=4096,
        description="prune during decode every N generated tokens (0: prefill only)",
    )


class ARKV(KVPolicy):
    """ARKV: per-layer original/quantized budget split by attention statistics."""

    method: Literal["arkv"] = "arkv"
    evicts: ClassVar[bool] = True
    quantizes: ClassVar[bool] = True
    budget: Budget = 1024
    window: int = Field(32, ge=1, le=4096, description="observation window (queries)")
    tau1: float = Field(7.774, gt=0.0, le=1000.0)
    tau2: float = Field(5.407, gt=0.0, le=1000.0)
    tau3: float = Field(5.528, gt=0.0, le=1000.0)
    gamma: float = Field(263.81, ge=0.0, le=1e6)
    quant_bits: Literal[2, 4] = 4


class StreamingLLM(KVPolicy):
    """StreamingLLM: attention sinks + most recent tokens."""

    method: Literal["streamingllm"] = "streamingllm"
    evicts: ClassVar[bool] = True
    budget: Budget = 1024
    sinks: int = Field(4, ge=0, le=4096)

    @model_validator(mode="after")
    def _sinks_fit(self) -> StreamingLLM:
        if self.sinks >= self.budget:
            raise ValueError(f"sinks: must be < budget ({self.budget}), got {self.sinks}")
        return self


class SnapKV(KVPolicy):
    """SnapKV: observation-window attention, pooled, top-k per KV head."""

    method: Literal["snapkv"] = "snapkv"
    evicts: ClassVar[bool] = True
    budget: Budget = 1024
    window: int = Field(64, ge=1, le=4096, description="observation window (last queries)")
    kernel: int = Field(5, ge=1, le=63, description="avg-pool kernel (odd)")

    @field_validator("kernel")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError(f"kernel: must be odd, got {v}")
        return v


class H2O(KVPolicy):
    """H2O heavy hitters (kvpress ObservedAttention) + a recent window."""

    method: Literal["h2o"] = "h2o"
    evicts: ClassVar[bool] = True
    budget: Budget = 1024
    recent: int = Field(64, ge=0, le=MAX_BUDGET, description="recent tokens always kept")


class UniformQuant(KVPolicy):
    """KIVI-style uniform quantization of every token (K per channel, V per token)."""

    method: Literal["uniform_quant"] = "uniform_quant"
    quantizes: ClassVar[bool] = True
    bits: Literal[2, 4] = 4
    residual: int = Field(
        128, ge=0, le=MAX_BUDGET, description="most recent tokens kept at full precision (KIVI R)"
    )


Policy = Annotated[
    Union[FullCache, IntentKV, TriAxialKV, KVzap, ARKV, StreamingLLM, SnapKV, H2O, UniformQuant],
    Field(discriminator="method"),
]
POLICY_CLASSES: dict[str, type[KVPolicy]] = {
    cls.model_fields["method"].default: cls
    for cls in (
        FullCache,
        IntentKV,
        TriAxialKV,
        KVzap,
        ARKV,
        StreamingLLM,
        SnapKV,
        H2O,
        UniformQuant,
    )
}
_POLICY_ADAPTER: TypeAdapter[Any] = TypeAdapter(Policy, config=ConfigDict(title="policy"))


def parse_policy(data: Mapping[str, Any] | KVPolicy | str) -> KVPolicy:
    """A policy from its wire dict (``{"method": "intentkv", "budget": 512}``) or a spec
    string (``"intentkv:budget=512"``, see :func:`parse_policy_spec`)."""
    if isinstance(data, KVPolicy):
        return data
    if isinstance(data, str):
        return parse_policy_spec(data)
    return _POLICY_ADAPTER.validate_python(data)


def parse_policy_spec(spec: str) -> KVPolicy:
    """A policy from a CLI spec: ``"full"``, ``"intentkv:budget=512,memory_decay=0.7"``."""
    method, _, rest = spec.strip().partition(":")
    method = method.strip().lower()
    if method not in POLICY_CLASSES:
        close = difflib.get_close_matches(method, POLICY_CLASSES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown policy {method!r}{hint}; expected one of {sorted(POLICY_CLASSES)}"
        )
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"policy spec {spec!r}: expected key=value, got {item!r}")
        kwargs[key.strip()] = _spec_value(val.strip())
    return POLICY_CLASSES[method].model_validate(kwargs)


def _spec_value(text: str) -> Any:
    """A spec value as a JSON number or boolean when it reads as one, else the string.

    Pydantic's lax mode turns "512" into 512 for ``int`` fields but not for ``Literal[2, 4]``
    ones (``bits``, ``quant_bits``), so numbers are converted here.
    """
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (bool, int, float)) else text


class UnknownNodeError(ValueError):
    """A per-node policy names a node the graph does not have."""


def unknown_node_message(unknown: Iterable[str], known: Iterable[str], where: str) -> str:
    """ "``where`` names nodes that do not exist in the graph: 'brwose' (did you mean
    'browse'?); nodes are: [...]"."""
    known = sorted(set(known))
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"{where} name nodes that do not exist in the graph: {', '.join(parts)}; nodes are: {known}"
    )


def _spec_to_policy(value: Any) -> Any:
    """Spec strings (``"h2o:budget=32"``) are accepted wherever a policy is."""
    return parse_policy_spec(value) if isinstance(value, str) else value


class GraphPolicy(BaseModel):
    """A default policy plus per-node overrides."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: Policy = Field(default_factory=FullCache)
    nodes: Annotated[dict[str, Policy], _READ_ONLY, _AS_DICT] = Field(default_factory=dict)

    @field_validator("default", mode="before")
    @classmethod
    def _default_spec(cls, v: Any) -> Any:
        return _spec_to_policy(v)

    @field_validator("nodes", mode="before")
    @classmethod
    def _node_specs(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: _spec_to_policy(p) for k, p in v.items()}
        return v

    def merged(self, override: GraphPolicy) -> GraphPolicy:
        """This policy with ``override`` on top: its nodes replace or add to these, and its
        default replaces this default when it was given (``model_fields_set``)."""
        default = override.default if "default" in override.model_fields_set else self.default
        return GraphPolicy(default=default, nodes={**self.nodes, **override.nodes})

    def for_node(self, node: str | None) -> KVPolicy:
        if node is not None and node in self.nodes:
            return self.nodes[node]
        return self.default

    def check_nodes(self, known: Iterable[str]) -> None:
        """Raise :class:`UnknownNodeError` if an override names a node not in ``known``."""
        known = set(known)
        unknown = set(self.nodes) - known
        if unknown:
            raise UnknownNodeError(unknown_node_message(unknown, known, "policy overrides"))
