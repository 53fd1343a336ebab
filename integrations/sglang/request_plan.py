"""One SGLang request's agentkv state: payload, per-token tags, plan, and the plan applied to
SGLang's ``req_to_token`` row.

The wire payload rides in ``custom_params["agentkv"]`` (:mod:`agentkv.wire`); the HTTP process
tags the prompt with agentkv's token tagger on SGLang's own tokenisation and adds the tags as
``custom_params["agentkv_tags"]`` (:func:`encode_tags`), so the scheduler process, which sees
only token ids, gets them with the request. Planning is the embedded engine's: the same
``Method`` registry, the same :class:`~agentkv.methods.base.PlanContext`.

Shapes: ``T`` prompt tokens; ``L`` layers, ``Hkv`` KV heads, ``D`` head dim.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.methods.base import MethodSet, ModelShape, Plan, PlanContext
from agentkv.tags import NUM_TAG_CODES, Role, TagCode
from agentkv.token_tagger import TokenTags
from agentkv.wire import WIRE_KEY, KVPayload, PayloadError, decode_payload

#: marks a radix namespace (``extra_key``) as a session's: ``<tenant>SESSION_MARK<session>#<gen>``
SESSION_MARK = "\x1fagentkv-session\x1f"

#: ``custom_params`` key of the tags the HTTP process computed (a JSON string).
TAGS_KEY = "agentkv_tags"

#: policy methods the plugin serves on SGLang: eviction only (no quantized pools yet); KVzap
#: in prefill (layer inputs from :mod:`.hidden_states`; no pruning while decoding).
SGLANG_METHODS = frozenset({"full", "streamingllm", "snapkv", "h2o", "intentkv", "kvzap"})


def check_payload(raw: Any) -> KVPayload:
    """Decode and check a payload for SGLang: :class:`~agentkv.wire.PayloadError` (a
    ``ValueError``, SGLang's HTTP 400) names the field."""
    payload = decode_payload(raw)
    if payload.policy.method not in SGLANG_METHODS:
        raise PayloadError(
            f"agentkv payload field 'policy.method': {payload.policy.method!r} is not served by "
            f"agentkv on SGLang; served: {sorted(SGLANG_METHODS)}",
            field="policy.method",
        )
    return payload


#: per model shape, the HTTP process's method instances (KVzap caches its surrogates there).
_HTTP_METHODS: dict[ModelShape, MethodSet] = {}


def model_shape(model_config: Any, tp_size: int = 1) -> ModelShape:
    """The shape one TP rank plans with, from SGLang's ``ModelConfig`` (the HTTP process has
    no KV pool; the scheduler's :func:`~.runtime.init_planner` reads the same from it)."""
    return ModelShape(
        int(model_config.num_hidden_layers),
        int(model_config.num_attention_heads) // max(1, tp_size),
        int(model_config.get_num_kv_heads(max(1, tp_size))),
        int(model_config.head_dim),
    )


def check_method(payload: KVPayload, model_config: Any, tp_size: int = 1) -> None:
    """``Method.check`` in the HTTP process, as the embedded engine runs it before a request:
    a policy whose trained artifact is missing (KVzap without a surrogate for this model, a
    bad ``surrogate_path``) is a :class:`~agentkv.wire.PayloadError` naming the field."""
    shape = model_shape(model_config, tp_size)
    methods = _HTTP_METHODS.get(shape)
    if methods is None:
        methods = _HTTP_METHODS[shape] = MethodSet(shape)
    try:
        methods.for_policy(payload.policy)
    except ValueError as e:
        field = str(getattr(e, "field", "") or "policy").removeprefix("payload.")
        raise PayloadError(str(e), field=field) from e


_USER = TagCode.pack(Role.USER)

logger = logging.getLogger("agentkv.sglang")


@dataclass
class HoleyRequests:
    """Per process: how many running requests have DEAD positions in their ``req_to_token``
    row, and the DEAD slot id. The attention backend compacts its metadata only while
    ``count > 0``."""

    count: int = 0
    dead_slot: int | None = None

    def mark(self, state: AgentKVRequest) -> None:
        if not state.holey:
            state.holey = True
            self.count += 1

    def release(self, state: AgentKVRequest) -> None:
        if state.holey:
            state.holey = False
            self.count -= 1


HOLEY = HoleyRequests()


def encode_tags(tags: TokenTags) -> str:
    """Compact JSON string of a request's tags for ``custom_params[TAGS_KEY]``: codes as
    base64 bytes, the actionable set as ``[start, end)`` runs."""
    runs: list[list[int]] = []
    for i, a in enumerate(tags.actionable):
        if a:
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
    return json.dumps(
        {
            "n": len(tags.token_ids),
            "codes": base64.b64encode(bytes(tags.codes)).decode(),
            "actionable": runs,
            "protected_prefix": tags.protected_prefix,
            "tail_start": tags.tail_start,
        },
        separators=(",", ":"),
    )


def decode_tags(raw: str, token_ids: Sequence[int]) -> TokenTags | None:
    """Tags for ``token_ids`` from :func:`encode_tags`' string; None when they do not fit
    (another length, a malformed string)."""
    try:
        d = json.loads(raw)
        codes = list(base64.b64decode(d["codes"]))
        n = int(d["n"])
        actionable = [False] * n
        for s, e in d["actionable"]:
            for i in range(max(0, int(s)), min(n, int(e))):
                actionable[i] = True
        protected, tail = int(d["protected_prefix"]), int(d["tail_start"])
    except (ValueError, KeyError, TypeError):
        return None
    if n != len(token_ids) or len(codes) != n or not (0 <= protected <= n and 0 <= tail <= n):
        return None
    if any(c >= NUM_TAG_CODES for c in codes):  # /generate callers can send their own
        return None
    return TokenTags(
        token_ids=list(token_ids),
        codes=codes,
        message_index=[-1] * n,
        protected_prefix=protected,
        actionable=actionable,
        tail_start=tail,
    )


def untagged(token_ids: Sequence[int]) -> TokenTags:
    """Tags when none came with the request (``/generate`` with ids, a template the tagger
    could not align): every token user text, no actionable span, no protected prefix."""
    n = len(token_ids)
    return TokenTags(list(token_ids), [_USER] * n, [-1] * n, 0, [False] * n, n)


@dataclass
class AgentKVRequest:
    """What the plugin keeps for one SGLang request (attached to ``Req`` as ``req.agentkv``).

    Attributes:
        payload: the decoded wire payload.
        tags: per-token tags of the prompt (``untagged`` when none came along).
        tagged: whether the tags came from the tagger (False: :func:`untagged`).
        namespace: SGLang's ``extra_key`` of the request (``cache_salt`` + ``extra_key``):
            the tenant namespace. Sessions live inside it.
        planned: the plan ran for the current prefill (reset when the request is retracted).
        holey: the request's row holds DEAD positions now (counted in :data:`HOLEY`).
        observer: the method's prefill observer while the prompt is being computed.
        usage: telemetry of the plan (``evicted_tokens``, ``live_kv_tokens`` after it,
            ``plan_note``, ``planned_at``, ...; :mod:`.usage` reads it).
        seen_at: ``time.perf_counter()`` when the request entered the scheduler's queue.
        dead_in_prefix: DEAD positions in the prefix it matched (a session's holes).
        intact_prefix: the prefix indices last matched in the shared namespace, which holds
            no DEAD (``req.prefix_indices is intact_prefix``: no count, no host read).
    """

    payload: KVPayload
    tags: TokenTags
    tagged: bool
    namespace: str | None
    planned: bool = False
    holey: bool = False
    observer: Any = None
    usage: dict[str, Any] = field(default_factory=dict)
    seen_at: float = 0.0
    dead_in_prefix: int = 0
    intact_prefix: Any = None

    @property
    def session_key(self) -> str:
        """The session's radix namespace root: tenant namespace + session id."""
        return f"{self.namespace or ''}{SESSION_MARK}{self.payload.session_id}"

    @property
    def evicts(self) -> bool:
        return self.payload.policy.evicts

    def prompt_rows(self, prefix: int, n: int) -> int:
        """Of an extend chunk of ``n`` rows after ``prefix`` computed positions, how many are
        prompt positions (the ones its observer covers): a retracted request is run again over
        its prompt and the tokens it had generated."""
        return max(0, min(n, len(self.tags) - prefix))


def request_state(req: Any) -> AgentKVRequest | None:
    """The agentkv state of an SGLang ``Req`` (decoded once, cached as ``req.agentkv``); None
    when the request carries no agentkv payload, or one this plugin cannot serve (logged: the
    chat endpoint answers those with a 400 first; ``/generate`` runs them as stock SGLang)."""
    state = getattr(req, "agentkv", None)
    if state is not None or getattr(req, "agentkv_checked", False):
        return state
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
    req.agentkv_checked = True
    if not isinstance(params, Mapping) or params.get(WIRE_KEY) is None:
        return None
    try:
        payload = check_payload(params[WIRE_KEY])
    except PayloadError as e:  # /generate has no HTTP-side check: never let it reach here
        logger.warning("agentkv: request %s runs as stock SGLang: %s", getattr(req, "rid", "?"), e)
        return None
    ids = list(req.origin_input_ids)
    tags = decode_tags(params[TAGS_KEY], ids) if isinstance(params.get(TAGS_KEY), str) else None
    state = AgentKVRequest(
        payload=payload,
        tags=tags if tags is not None else untagged(ids),
        tagged=tags is not None,
        namespace=getattr(req, "extra_key", None),
    )
    req.agentkv = state
    return state


def plan_request(
    state: AgentKVRequest,
    methods: MethodSet,
    shape: ModelShape,
    live: torch.Tensor,
    read_keys: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> Plan:
    """Run the request's method over its prompt. ``live``: bool ``[T]``, position not DEAD
    (holes a session's earlier turns left)."""
    policy = state.payload.policy
    method = methods.for_policy(policy)
    tags = state.tags
    ctx = PlanContext(
        policy=policy,
        session_id=state.payload.session_id,
        shape=shape,
        seq_len=len(tags),
        live=live,
        forced=torch.tensor(tags.forced(method.protects_system(policy)), dtype=torch.bool),
        actionable=torch.tensor(tags.actionable, dtype=torch.bool),
        tag_codes=torch.tensor(tags.codes, dtype=torch.uint8),
        read_keys=read_keys,
        observation=state.observer.result() if state.observer is not None else None,
    )
    return method.plan(ctx)


def evicted_positions(plan: Plan, seq_len: int) -> torch.Tensor:
    """Positions (int64 ``[k]``, ascending) whose slot goes: evicted in every layer and head.

    SGLang's pool row holds every layer and KV head of a token, so a per-(layer, head)
    ``keep_mask`` frees a slot only where no (layer, head) keeps the position; positions kept
    by some heads stay whole (those heads' reads are not masked: the SGLang kernels have no
    per-head index)."""
    drop = torch.zeros(seq_len, dtype=torch.bool)
    if plan.evict is not None and plan.evict.numel():
        drop[plan.evict.to(torch.int64)] = True
    if plan.keep_mask is not None:  # (over positions keep_start ..)
        km = plan.keep_mask.to(torch.bool)
        a = plan.keep_start
        span = ~km.reshape(-1, km.shape[-1]).any(dim=0)
        drop[a : a + span.numel()] |= span[: max(seq_len - a, 0)]
    return torch.nonzero(drop).reshape(-1)


def apply_evictions(
    req_to_token: torch.Tensor,
    row: int,
    positions: torch.Tensor,
    protected_len: int,
    allocator: Any,
    live: torch.Tensor | None = None,
) -> tuple[int, int]:
    """Redirect ``positions`` (int64 ``[k]``, on the host) of ``req_to_token[row]`` to DEAD
    and drop the request's reference on the slots it owns (positions ``>= protected_len``;
    the matched prefix below it belongs to the radix tree, which keeps it for other requests).
    Returns ``(positions newly made DEAD, slots freed)``: the freed ones are those the
    request owned, its reference dropped.

    ``live``: bool ``[T]`` on the host, the row's positions not DEAD now (what the plan saw):
    then which positions are new (and both counts) are known on the host and nothing is read
    back; without it the row is read (one mask and its count)."""
    if positions.numel() == 0:
        return 0, 0
    if live is not None:
        positions = positions.cpu()
        return _redirect_live(
            req_to_token, row, positions[live[positions]], protected_len, allocator
        )
    dead = allocator.dead_slot
    pos = positions.to(device=req_to_token.device, dtype=torch.int64)
    old = req_to_token[row, pos].to(torch.int64)
    fresh = old != dead
    pos, old = pos[fresh], old[fresh]
    req_to_token[row, pos] = dead
    owned = pos >= protected_len
    freed = old[owned]
    allocator.free(freed)
    return int(pos.numel()), int(freed.numel())


def _redirect_live(
    req_to_token: torch.Tensor,
    row: int,
    positions: torch.Tensor,
    protected_len: int,
    allocator: Any,
) -> tuple[int, int]:
    """:func:`apply_evictions` of host ``positions`` (int64 ``[k]``) known not to be
    DEAD: the owned ones selected on the host, then gathers and writes on the row's device
    only."""
    owned = positions[positions >= protected_len].to(req_to_token.device)
    if owned.numel():
        allocator.free(req_to_token[row, owned].to(torch.int64))
    pos = positions.to(req_to_token.device)
    req_to_token[row, pos] = allocator.dead_slot
    return int(positions.numel()), int(owned.numel())
