"""The method protocol: observe prefill, then return a plan. Methods never touch storage.

One registry maps a policy's ``method`` name to its implementation; engines call
:func:`method_for` and never branch on method names.

Shapes: ``L`` layers, ``Hq`` query heads, ``Hkv`` KV heads (GQA group ``g = Hq // Hkv``),
``D`` head dim, ``T`` request tokens (logical positions ``0..T-1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from agentkv.cache.precision import Precision
from agentkv.policies import KVPolicy

#: ``read_keys(layer) -> (k [n, Hkv, D], positions int64 [n], head_mask bool [Hkv, n] | None)``:
#: post-RoPE keys of the positions the layer still attends to (DEAD dropped).
KeyReader = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a HF model with this ``config`` (no ``num_key_value_heads``: MHA; no
        ``head_dim``: ``hidden_size / num_attention_heads``)."""
        hq = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_q_heads=hq,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or hq,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // hq,
        )


@dataclass
class PlanContext:
    """What a method may look at when planning one request.

    Attributes:
        policy: the request's policy.
        session_id: the request's session (``req:`` ids are request-local).
        shape: model shape.
        seq_len: ``T``, positions with KV after prefill.
        live: bool ``[T]``, position not DEAD before the plan (holes of earlier turns are False).
        forced: bool ``[T]``, must be kept (actionable query, generation-prompt tail, and the
            protected system prefix when the policy protects it).
        actionable: bool ``[T]``, the actionable query span.
        tag_codes: uint8 ``[T]`` :class:`agentkv.tags.TagCode` per position.
        read_keys: see :data:`KeyReader`.
        observation: ``observer.result()`` of the method's prefill observer (or None).
    """

    policy: KVPolicy
    session_id: str
    shape: ModelShape
    seq_len: int
    live: torch.Tensor
    forced: torch.Tensor
    actionable: torch.Tensor
    tag_codes: torch.Tensor
    read_keys: KeyReader
    observation: Any = None


@dataclass(frozen=True)
class DecodePrecision:
    """What happens to tokens a request appends after its plan (decode steps): once more than
    ``residual`` of them are at full precision, the oldest are quantized to ``precision``,
    32 at a time (a whole page), so the newest ``residual`` stay at full precision (KIVI)."""

    precision: Precision
    residual: int


@dataclass
class Plan:
    """A method's decision for one request: evict, then quantize what survives.

    Attributes:
        evict: int64 ``[k]`` positions evicted in every layer and head, or None.
        keep_mask: bool ``[L, Hkv, T']`` per-(layer, KV head) keep decision (False = evict)
            of positions ``keep_start .. keep_start + T' - 1`` (others untouched), or None. A
            cell evicted in one (layer, head) frees that cell's bytes.
        keep_start: the first position ``keep_mask`` covers (a decode-time pass: its window).
        precision: int8 :class:`~agentkv.cache.Precision` values broadcastable to
            ``[L, Hkv, T]`` (``[T]`` per position, ``[L, 1, T]`` per layer, ...): ``INT4`` /
            ``INT2`` quantize a kept full-precision cell (INT2 in pages of 32 per column; the
            rest of a column's INT2 cells that do not fill a page go to INT4), ``FULL`` keeps
            it. None = everything kept stays at full precision.
        decode: what decode steps do with the tokens they append (None: stay full).
        scores: optional float ``[T]`` (or ``[L, Hkv, T]``) scores, for telemetry and tests.
        note: free text for telemetry (e.g. "below budget: nothing evicted").
    """

    evict: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None
    keep_start: int = 0
    precision: torch.Tensor | None = None
    decode: DecodePrecision | None = None
    scores: torch.Tensor | None = None
    note: str = ""

    @property
    def is_noop(self) -> bool:
        return (
            (self.evict is None or self.evict.numel() == 0)
            and self.keep_mask is None
            and self.precision is None
            and self.decode is None
        )


class PrefillObserver:
    """Receives each layer's attention inputs during prefill (post-RoPE), chunk by chunk.

    ``q``: ``[Hq, n_q, D]`` queries at int64 ``q_positions [n_q]``; ``k``: ``[Hkv, n_k, D]``
    live keys at ``k_positions [n_k]`` (ascending, includes the chunk's own keys);
    ``head_mask``: bool ``[Hkv, n_k]`` or None. Causality: query ``i`` sees key ``j`` iff
    ``k_positions[j] <= q_positions[i]``.

    ``reads_keys`` False: :meth:`observe` ignores ``k`` / ``k_positions`` / ``head_mask``, and
    an engine may pass None for them instead of gathering the live keys.

    ``sums_queries`` True: all the observer keeps of a layer's queries is their sums over
    rows it chooses by position (IntentKV's mean query). An engine that batches requests may
    then skip :meth:`observe` and compute those sums for every such request of a batch at
    once: it asks :meth:`query_sum_masks` which rows feed which sum, and hands the sums to
    :meth:`add_query_sums` (same result as calling :meth:`observe` per layer, up to the
    float32 summation order).

    Decode steps replayed from a CUDA graph run no Python: an observer that takes decode
    steps (:meth:`observe_hidden`) records them from inside the capture into buffers it makes
    in :meth:`before_capture`, and the engine calls :meth:`collect` at least every
    :attr:`collect_every` decode steps (0: never needed) and :meth:`end_decode` when the
    request's decode ends.
    """

    reads_keys: ClassVar[bool] = True
    sums_queries: ClassVar[bool] = False
    collect_every: ClassVar[int] = 0

    def observe(
        self,
        layer: int,
        q: torch.Tensor,
        q_positions: torch.Tensor,
        k: torch.Tensor,
        k_positions: torch.Tensor,
        head_mask: torch.Tensor | None,
    ) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def query_sum_masks(self, q_positions: torch.Tensor) -> torch.Tensor:
        """With :attr:`sums_queries`: bool ``[S, n]``, which of the rows at int64
        ``q_positions [n]`` (CPU) feed each of the observer's ``S`` query sums."""
        raise NotImplementedError

    def add_query_sums(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """With :attr:`sums_queries`: add float32 ``sums [L, S, Hq, D]`` (sum ``s`` of layer
        ``l``: the post-RoPE queries of the rows ``query_sum_masks(...)[s]`` selected) and
        int64 ``counts [S]`` (CPU: how many rows each sum covers; the same in every layer)."""
        raise NotImplementedError

    def observe_hidden(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Optional: ``hidden [n, D_h]``, the input of decoder layer ``layer`` (residual stream,
        before its input norm) at int64 ``positions [n]``; in prefill, and in decode for
        methods that prune while decoding (:meth:`Method.decode_interval`)."""

    def before_capture(self, device: torch.device, dtype: torch.dtype) -> None:
        """Optional: a decode step of a model computing in ``dtype`` is about to be captured
        on ``device`` (make what the capture will write into: a capture records work, it
        runs none)."""

    def collect(self) -> None:
        """Optional: take in what replayed decode steps recorded (see the class notes)."""

    def end_decode(self) -> None:
        """Optional: the request's decode ended: take in what is left, free what decode
        steps needed."""

    def result(self) -> Any:
        return None


@dataclass
class ObserveRequest:
    """What a method wants to see during prefill, given the request's layout.

    Attributes:
        seq_len: ``T`` after prefill; ``num_cached``: positions reused from the prefix cache
        (not recomputed); ``actionable``: bool ``[T]``.
    """

    seq_len: int
    num_cached: int
    actionable: torch.Tensor
    shape: ModelShape


@dataclass
class DecodeContext:
    """What a method sees when asked to prune during decode.

    Attributes:
        policy, session_id, shape: as in :class:`PlanContext`.
        seq_len: positions with KV so far (prompt + decoded tokens written).
        observation: ``observer.result()`` of the request's observer (fed during decode).
    """

    policy: KVPolicy
    session_id: str
    shape: ModelShape
    seq_len: int
    observation: Any = None


class Method:
    """Base class: a stateless-per-request scorer with optional per-session state.

    A method declares what it needs; the engine never asks which method it runs:
    :attr:`observes_prefill` (the engine then computes, rather than reuses from the prefix
    cache, the positions up to the actionable query, so the observer sees them) and
    :meth:`protects_system` (the system / template prefix joins the forced set).
    """

    #: the policy ``method`` name this implementation serves.
    name: ClassVar[str] = ""
    #: whether :meth:`observer` returns an observer that must see the actionable query's
    #: prefill (queries are not stored, so those positions cannot come from the cache).
    observes_prefill: ClassVar[bool] = False

    def protects_system(self, policy: KVPolicy) -> bool:
        """Whether the protected system / template prefix is forced (kept) for ``policy``."""
        return True

    def observed_tail(self, policy: KVPolicy) -> int:
        """With :attr:`observes_prefill` and no actionable token: how many trailing positions
        the observer must see computed (IntentKV's fallback query window)."""
        return 1

    def __init__(self, shape: ModelShape):
        self.shape = shape

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        """An observer for this request's prefill, or None if the method needs none."""
        return None

    def plan(self, ctx: PlanContext) -> Plan:
        raise NotImplementedError

    def check(self, policy: KVPolicy) -> None:
        """Raise ``ValueError`` (message naming the field) if this engine cannot serve
        ``policy``, e.g. a missing trained artifact. Called before the request runs."""

    def prefix_reuse(self, policy: KVPolicy, session_id: str, limit: int) -> int:
        """Length (``1..limit``) of the prompt prefix offered to the prefix cache, which reuses
        at most that many minus one positions; the rest are recomputed (and observed)."""
        return limit

    def decode_interval(self, policy: KVPolicy) -> int:
        """Call :meth:`plan_decode` every this many decode steps (0: never)."""
        return 0

    def plan_decode(self, ctx: DecodeContext) -> Plan | None:
        """A plan over the positions so far while decoding (None: nothing to change)."""
        return None

    def end_session(self, session_id: str) -> None:
        """Forget per-session state."""


_REGISTRY: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: make ``cls`` the implementation of policies with ``method == cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def registered_methods() -> dict[str, type[Method]]:
    return dict(_REGISTRY)


def method_class(method_name: str) -> type[Method]:
    try:
        return _REGISTRY[method_name]
    except KeyError:
        raise ValueError(
            f"no implementation for policy method {method_name!r}; implemented: {sorted(_REGISTRY)}"
        ) from None


@dataclass
class MethodSet:
    """One long-lived instance per method for an engine (holds per-session state)."""

    shape: ModelShape
    _instances: dict[str, Method] = field(default_factory=dict)

    def for_policy(self, policy: KVPolicy) -> Method:
        inst = self._instances.get(policy.method)
        if inst is None:
            inst = self._instances[policy.method] = method_class(policy.method)(self.shape)
        inst.check(policy)
        return inst

    def end_session(self, session_id: str) -> None:
        for inst in self._instances.values():
            inst.end_session(session_id)


def topk_mask(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """bool ``[T]``: the ``k`` highest ``scores [T]`` among bool ``candidates [T]`` (all of
    them when ``k >= |C|``; ties: earlier), on the device of both, with no host read.

    One stable sort by score, then a stable sort that puts the candidates first: the
    candidates come out in the order a stable sort of their own scores gives."""
    keep = torch.zeros_like(candidates)
    if k <= 0:
        return keep
    order = torch.sort(scores.float(), descending=True, stable=True).indices  # [T]
    order = order[torch.sort((~candidates[order]).to(torch.uint8), stable=True).indices]
    top = order[:k]
    keep[top] = candidates[top]
    return keep


def topk_positions(scores: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (int64, ascending) of the ``k`` highest ``scores`` among bool
    ``candidates [T]`` (ties: earlier): :func:`topk_mask`'s."""
    return torch.nonzero(topk_mask(scores, candidates, k)).reshape(-1)


def expand_kv_heads(k: torch.Tensor, group: int) -> torch.Tensor:
    """``[Hkv, ...]`` -> ``[Hkv * group, ...]`` (KV heads expanded to query heads)."""
    return k.repeat_interleave(group, dim=0)
