"""The embedded engine: HF transformers model + agentkv attention + the KV store + methods.

One request at a time (a lock serialises them; the SGLang extension is the answer for
continuous batching). A request:

1. resolves its payload (policy, session id, annotations; absent -> FullCache),
2. renders the chat template and tags every token (:class:`ChatRenderer`),
3. matches the prefix cache (same session: holes included; other sessions: true prefixes),
4. prefills the rest in chunks through :class:`StoreCache` / ``agentkv_attention``, feeding the
   method's observer,
5. asks the method for a plan and applies it to the store (dead-slot redirect, per-head masks),
6. decodes (or teacher-forces a target), then caches the sequence for the next turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.annotation import MessageAnnotation, annotate_messages
from agentkv.cache import KVStore, OutOfSlots, Precision, RequestKV
from agentkv.engine.calibration import CALIBRATION_MESSAGES
from agentkv.engine.chat_template import ChatRenderer
from agentkv.engine.decode_graph import DecodeGraph
from agentkv.engine.decode_pruning import DecodePruning
from agentkv.engine.detokenizer import IncrementalText
from agentkv.engine.kernel_decode import KernelDecode
from agentkv.engine.model_loader import load_model, prepare_model
from agentkv.engine.store_cache import CACHE_KWARG, LiveView, StoreCache
from agentkv.engine.telemetry import KVUsage, SessionMetrics
from agentkv.engine.tool_calls import FOREIGN_TURN_MARKERS, parse_tool_calls
from agentkv.methods import (
    DecodePrecision,
    MethodSet,
    ModelShape,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
)
from agentkv.policies import FullCache, KVPolicy, parse_policy, parse_policy_spec
from agentkv.session import is_request_local, resolve_session_id, scope_session_id
from agentkv.tags import Modality, Role, TagCode, Temporal
from agentkv.token_tagger import TokenTags
from agentkv.wire import KVPayload


@dataclass
class CompressionResult:
    """A policy's prefill + plan on raw token ids (:meth:`Engine.compress`).

    Attributes:
        precision: int8 ``[L, Hkv, T]`` :class:`~agentkv.cache.Precision` of every cell after
            the plan (``EVICTED`` = 0, ``INT2`` = 2, ``INT4`` = 4, ``FULL`` = 16).
        kept: bool ``[L, Hkv, T]`` (``precision != EVICTED``).
        forced: bool ``[T]``: positions the method had to keep (query span, protected prefix).
        logits: float32 ``[V]`` next-token logits after the last token (before the plan).
        usage: telemetry of the run (resident and effective bytes, evictions, ...).
        plan: the method's :class:`~agentkv.methods.Plan`.
    """

    precision: torch.Tensor
    kept: torch.Tensor
    forced: torch.Tensor
    logits: torch.Tensor
    usage: KVUsage
    plan: Plan


class RequestError(ValueError):
    """A request the engine cannot serve as given (maps to HTTP 400). ``field`` names where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestCancelled(RuntimeError):
    """``GenerationConfig.should_stop`` said stop before the request started (client gone)."""


DEFAULT_MAX_TOKENS = 256
SAMPLING_EPS = 1e-5  # temperatures below this decode greedily


@dataclass
class GenerationConfig:
    """Decoding settings. ``max_tokens=None``: up to :data:`DEFAULT_MAX_TOKENS`, fewer when
    the context has less room left (a long prompt alone is not an error).

    ``should_stop``: polled before prefill and at every decode step (e.g. "has the client
    disconnected?"); ``True`` ends the request early with ``finish_reason="abort"``."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    #: keep decoding past end-of-turn tokens (benchmarks: a fixed number of decode steps).
    ignore_eos: bool = False
    should_stop: Callable[[], bool] | None = field(default=None, repr=False, compare=False)


@dataclass
class ChatResult:
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    token_ids: list[int]
    usage: KVUsage


@dataclass
class ScoreResult:
    """Teacher-forced scores of a target message.

    Attributes:
        target_ids: int64 ``[n]`` target tokens (the assistant message as the template renders it).
        logits: float32 ``[n, V]`` (CPU) next-token logits at each target position.
        usage: telemetry of the request.
        greedy_ids: greedy continuation from the compressed context (``greedy_tokens`` asked),
            stopping early at an end-of-turn token. Checked against a reference continuation
            (``score(greedy_reference=...)``): the reference itself when greedy decoding
            reproduces it, else the agreeing prefix plus the first token that differs.
        greedy_check: the argmax after each prefix of the checked continuation (the
            reference's, or this run's own ``greedy_ids`` when none was given), from one
            teacher-forced pass: ``[len + 1]`` ids, or ``[len]`` when the continuation is
            ``greedy_tokens`` long. Two runs agree on greedy decoding along a continuation
            iff their checks are equal; unlike ``greedy_ids``, which compares step-by-step
            decoding with a batched pass, the check compares like with like, so rounding
            cannot flip a near-tie on one side only.
    """

    target_ids: torch.Tensor
    logits: torch.Tensor
    usage: KVUsage
    greedy_ids: list[int] = field(default_factory=list)
    greedy_check: list[int] = field(default_factory=list)


@dataclass
class _Resolved:
    payload: KVPayload
    annotations: list[MessageAnnotation]


@dataclass
class PreparedChat:
    """A chat request validated, rendered and tagged (:meth:`Engine.prepare_chat`), not yet run.

    Preparing first lets a server reject bad input (HTTP 400) before it starts a stream.
    """

    payload: KVPayload
    tags: TokenTags
    gen: GenerationConfig
    namespace: str | None = None


TOOL_CALL_OPEN = "<tool_call>"


#: token id of a position whose step was launched before the host read its token (the
#: engine writes the real id as soon as it has read it)
_UNREAD = -1


@dataclasses.dataclass
class _Launched:
    """A decode step launched at ``pos``: its logits (float32 ``[V]``, computed or being
    computed) and, off the kernels' path, the cache it attended through."""

    pos: int
    logits: torch.Tensor
    cache: StoreCache | None


class _ContentStream:
    """Turns the growing decoded text into content deltas whose concatenation is exactly the
    final :attr:`ChatResult.content` (``""`` when None).

    Text that may still turn out to be a stop string, the start of a ``<tool_call>`` block
    (never content), trailing whitespace (stripped when a tool call follows) or an incomplete
    UTF-8 character is held back until it is decided.
    """

    def __init__(self, on_text: Callable[[str], None], stop: Sequence[str]):
        self.on_text = on_text
        self.stop = [s for s in stop if s]
        self.emitted = ""

    @staticmethod
    def _held_suffix(text: str, marker: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                return n
        return 0

    def update(self, text: str) -> None:
        safe = text
        for s in self.stop:
            i = safe.find(s)
            safe = safe[:i] if i >= 0 else safe[: len(safe) - self._held_suffix(safe, s)]
        for marker in (TOOL_CALL_OPEN, *FOREIGN_TURN_MARKERS):  # never content
            i = safe.find(marker)
            if i >= 0:
                safe = safe[:i]
            else:
                safe = safe[: len(safe) - self._held_suffix(safe, marker)]
        safe = safe.rstrip()
        if safe.endswith("\ufffd"):
            safe = safe.rstrip("\ufffd")
        self._emit(safe)

    def finish(self, content: str | None) -> None:
        self._emit(content or "")

    def _emit(self, target: str) -> None:
        if len(target) > len(self.emitted) and target.startswith(self.emitted):
            self.on_text(target[len(self.emitted) :])
            self.emitted = target


class Engine:
    """Embedded engine over one model.

    Args:
        model: local HF model directory, None for the default SmolLM2-135M-Instruct, or a
            causal LM already loaded (a transformers ``PreTrainedModel``, e.g. built from a
            config for a benchmark at a model's shape; it is switched to the agentkv
            attention and eval mode, and its device and dtype are used as they are).
        tokenizer: the tokenizer of a loaded ``model`` (required then; unused otherwise).
        device: ``"cpu"``, ``"cuda"``, ... (default: CUDA when available).
        dtype: model and KV dtype (default float32 on CPU, bfloat16 on CUDA).
        kv_slots: full-precision KV cells per (layer, KV head), the dead slot included (the
            tokens that fit at full precision).
        chunk_size: prefill chunk (tokens).
        int4_slots / int2_pages: quantized pool sizes per layer (defaults: ``kv_slots`` INT4
            cells and ``kv_slots // 32`` INT2 pages).
        decode_attention: ``"kernels"`` decodes through the fused Triton kernel over the
            pools (default on CUDA), ``"dense"`` through the gathered view and torch SDPA
            (default on CPU), ``"reference"`` through the kernels' torch reference (tests).
        key_channel_scales: INT4 key channel scales from calibration text: ``"absmax"``,
            ``"rms"`` or ``"none"`` (plain per-token groups).
        int4_compaction: before the kernels' decode, move INT4 cells that eviction left in
            32-cell runs filled below this fraction into whole runs
            (:meth:`KVStore.compact_int4`; 0, the default: never; e.g. 0.75).
        cuda_graphs: replay the kernels' decode steps from a CUDA graph (captured once per
            decode-index epoch, :class:`DecodeGraph`); default: on where decode runs on the
            kernels on CUDA (a method that prunes while decoding, KVzap, included: its
            observer records each replayed step's layer inputs on the device).
    """

    def __init__(
        self,
        model: str | torch.nn.Module | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kv_slots: int = 32768,
        chunk_size: int = 512,
        int4_slots: int | None = None,
        int2_pages: int | None = None,
        decode_attention: str | None = None,
        key_channel_scales: str = "none",
        int4_compaction: float = 0.0,
        tokenizer: Any = None,
        cuda_graphs: bool | None = None,
    ):
        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("a loaded model needs its tokenizer (Engine(model, tokenizer=))")
            p = next(model.parameters())
            if device is not None and torch.device(device).type != p.device.type:
                raise ValueError(f"the model is on {p.device}, not {device}: move it first")
            if dtype is not None and dtype != p.dtype:
                raise ValueError(f"the model is {p.dtype}, not {dtype}: convert it first")
            self.model, self.tokenizer = prepare_model(model), tokenizer
            self.model_name = str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        else:
            self.model, self.tokenizer = load_model(model, device, dtype)
            self.model_name = str(model) if model else "SmolLM2-135M-Instruct"
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        # transformers 5.24 renamed the models' past_key_values argument to cache (the old
        # name warns, and goes in 5.40); 5.17-5.23 know only past_key_values
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        cfg = self.model.config
        self.shape = ModelShape.from_config(cfg)
        head_dim = self.shape.head_dim
        self.max_context = int(getattr(cfg, "max_position_embeddings", 8192))
        self.store = KVStore(
            self.shape.num_layers,
            self.shape.num_kv_heads,
            head_dim,
            kv_slots,
            dtype=self.dtype,
            device=self.device,
            int4_slots=int4_slots,
            int2_pages=int2_pages,
            int4_min_density=int4_compaction,
        )
        if decode_attention is None:
            decode_attention = "kernels" if self.device.type == "cuda" else "dense"
        if decode_attention not in ("kernels", "dense", "reference"):
            raise ValueError(
                f"decode_attention must be kernels|dense|reference, got {decode_attention!r}"
            )
        self.decode_attention = decode_attention
        graphs_possible = decode_attention == "kernels" and self.device.type == "cuda"
        if cuda_graphs and not graphs_possible:
            raise ValueError(
                "cuda_graphs needs decode_attention='kernels' on a CUDA device "
                f"(got {decode_attention!r} on {self.device.type})"
            )
        #: the decode step's CUDA graph (None: steps run eagerly)
        self.decode_graph = (
            DecodeGraph(
                self._graph_forward,
                self.shape.num_layers * self.shape.num_kv_heads,
                self.device,
                self.dtype,
            )
            if graphs_possible and cuda_graphs is not False
            else None
        )
        #: launch each graph step before reading the token it feeds (the host's step work
        #: overlaps the GPU's; same tokens); False: one step at a time (benchmarks)
        self.decode_overlap = True
        self.methods = MethodSet(self.shape)
        self.renderer = ChatRenderer(self.tokenizer)
        self.chunk_size = chunk_size
        self.sessions = SessionMetrics()
        #: the most recent requests' telemetry, oldest first.
        self.request_log: deque[KVUsage] = deque(maxlen=10000)
        self._lock = threading.Lock()
        self._stop_ids = self._stop_token_ids()
        if key_channel_scales not in ("absmax", "rms", "none"):
            raise ValueError(
                f"key_channel_scales must be absmax|rms|none, got {key_channel_scales!r}"
            )
        self.key_channel_scales = key_channel_scales
        self._calibrate()

    # ------------------------------------------------------------------ public
    def chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        payload: KVPayload | None = None,
        gen: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> ChatResult:
        """Answer a chat request.

        ``on_text`` receives content deltas as they are decoded; they concatenate to exactly
        the result's ``content`` (stop strings and ``<tool_call>`` blocks are never streamed).
        """
        return self.run_chat(self.prepare_chat(messages, tools, payload, gen), on_text)

    def prepare_chat(
        self,
        messages: Sequence[Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        payload: KVPayload | None = None,
        gen: GenerationConfig | None = None,
        namespace: str | None = None,
    ) -> PreparedChat:
        """Validate, render and tag a chat request; raises :class:`RequestError` on bad input.

        ``namespace``: the tenant scope (cache salt) of the request: its session id, method
        state, session telemetry and prefix-cache matches stay inside it."""
        gen = gen or GenerationConfig()
        resolved = self._resolve(messages, payload)
        tags = self._encode(messages, tools, resolved.annotations, add_generation_prompt=True)
        if gen.max_tokens is None:
            limit = min(self.max_context, self.kv_capacity)
            room = max(limit - len(tags), 1)  # no room at all: the check says so
            gen = dataclasses.replace(gen, max_tokens=min(DEFAULT_MAX_TOKENS, room))
        self._check_length(len(tags), gen.max_tokens)
        payload = resolved.payload
        if namespace is not None:
            scoped = scope_session_id(namespace, payload.session_id)
            payload = payload.model_copy(update={"session_id": scoped})
        return PreparedChat(payload, tags, gen, namespace)

    def run_chat(
        self, prepared: PreparedChat, on_text: Callable[[str], None] | None = None
    ) -> ChatResult:
        """Prefill, plan and decode a :class:`PreparedChat` (see :meth:`chat`)."""
        payload, tags, gen = prepared.payload, prepared.tags, prepared.gen
        stream = None if on_text is None else _ContentStream(on_text, gen.stop)
        t0 = time.perf_counter()
        with self._lock:
            if gen.should_stop is not None and gen.should_stop():
                raise RequestCancelled("cancelled before it started")
            req, logits, plan_info = self._prefill_and_plan(tags, payload, prepared.namespace)
            ok = False
            try:
                t1 = self._sync_time()
                out_ids, finish, (raw, eff) = self._decode(req, logits, gen, stream, plan_info)
                t2 = self._sync_time()
                usage = self._usage(req, payload, tags, len(out_ids), plan_info, t0)
                ok = True
            finally:
                self.store.finish_request(req, cache=ok)  # a failed request is never cached
        usage = usage.model_copy(
            update={
                "raw_kv_reads": raw,
                "effective_kv_reads": eff,
                "prefill_time_s": round(t1 - t0, 4),
                "decode_time_s": round(t2 - t1, 4),
            }
        )
        self._record(usage)
        text = self._truncate_at_stop(self.tokenizer.decode(out_ids, skip_special_tokens=True), gen)
        content, calls = parse_tool_calls(text)
        if calls:
            finish = "tool_calls"
        if stream is not None:
            stream.finish(content)
        return ChatResult(text, content, calls, finish, out_ids, usage)

    def score(
        self,
        messages: Sequence[Any],
        target: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
        payload: KVPayload | None = None,
        greedy_tokens: int = 0,
        greedy_reference: Sequence[int] | None = None,
    ) -> ScoreResult:
        """Teacher-force ``target`` (an assistant message) after ``messages``.

        The context is held as the policy leaves it after prefill (evictions applied); the
        target's tokens then attend to it, as decode steps would. With ``greedy_tokens > 0``,
        the model first continues greedily from the same state for that many tokens in a fork
        that writes nothing to the store (``ScoreResult.greedy_ids``), then takes the argmax
        after each prefix of that continuation in one teacher-forced pass
        (``ScoreResult.greedy_check``). With ``greedy_reference`` (another run's
        ``greedy_ids``, e.g. FullCache's) it skips the decode steps and checks that
        continuation instead: greedy decoding reproduces a sequence iff each of its tokens
        is the argmax after its prefix, and two runs with equal checks make the same greedy
        choices along it. The prompt and target are cached for the session's next turn.
        """
        resolved = self._resolve(messages, payload)
        prompt = self._encode(messages, tools, resolved.annotations, add_generation_prompt=True)
        full_msgs = [*messages, target]
        full = self._encode(
            full_msgs, tools, annotate_messages(full_msgs), add_generation_prompt=False
        )
        n = len(prompt)
        if full.token_ids[:n] != prompt.token_ids:
            raise RequestError("the chat template does not render the target as a continuation")
        target_ids = full.token_ids[n:]
        if not target_ids:
            raise RequestError("empty target message", field="target")
        self._check_length(n, len(target_ids))
        t0 = time.perf_counter()
        with self._lock:
            req, logits, plan_info = self._prefill_and_plan(prompt, resolved.payload)
            try:
                greedy, check = [], []
                if greedy_tokens:
                    greedy = (
                        self._greedy_fork(req, logits, greedy_tokens)
                        if greedy_reference is None
                        else [int(t) for t in greedy_reference][:greedy_tokens]
                    )
                    check = self._greedy_check(req, logits, greedy, greedy_tokens)
                    if greedy_reference is not None:
                        greedy = self._greedy_along(greedy, check, greedy_tokens)
                positions = torch.arange(n, n + len(target_ids) - 1)
                if positions.numel():
                    slots = self.store.extend(req, target_ids[:-1])  # [L * Hkv, m - 1]
                    pruning = plan_info["decode_pruning"]  # its observer scores the target too
                    observer = pruning.observer if pruning is not None else None
                    cache = StoreCache(LiveView(self.store, req), positions, slots, observer)
                    tail_logits = self._forward(
                        target_ids[:-1], positions, cache, keep=positions.numel()
                    )
                    live_before = cache.attended_keys / self.shape.num_layers - positions.numel()
                    all_logits = torch.cat([logits[None], tail_logits], dim=0)
                else:
                    live_before, all_logits = (
                        float(req.slot_map.effective_live_tokens()),
                        logits[None],
                    )
                m = len(target_ids)
                raw = sum(n + j for j in range(m))
                eff = int(round(sum(live_before + 1 + j for j in range(m))))
                usage = self._usage(req, resolved.payload, prompt, m, plan_info, t0)
            finally:
                self.store.finish_request(req, cache=True)
        usage = usage.model_copy(update={"raw_kv_reads": raw, "effective_kv_reads": eff})
        self._record(usage)
        return ScoreResult(torch.tensor(target_ids), all_logits.float().cpu(), usage, greedy, check)

    def compress(
        self,
        token_ids: Sequence[int] | TokenTags,
        policy: KVPolicy | Mapping[str, Any] | str = "full",
        actionable: Sequence[bool] | None = None,
        session_id: str | None = None,
    ) -> CompressionResult:
        """Run ``policy``'s prefill + plan on raw ``token_ids`` (no chat template, no tags:
        every token is user text of the current turn) and return the decision per cell, as
        kvpress users evaluate a press on a context.

        Args:
            token_ids: the context, ``T >= 1`` ids; or a rendered, tagged chat
                (``engine.renderer.encode(...)``), whose tags the method then reads.
            policy: a policy, its wire dict or a spec string (``"snapkv:budget=64"``).
            actionable: optional bool ``[T]``: the query span (IntentKV reads it; forced).
            session_id: reuse / extend a session's prefix cache (default: request-local,
                nothing cached).
        """
        ids = (
            list(token_ids.token_ids)
            if isinstance(token_ids, TokenTags)
            else [int(t) for t in token_ids]
        )
        if not ids:
            raise RequestError("token_ids must not be empty", field="token_ids")
        if isinstance(policy, str):
            policy = parse_policy_spec(policy)
        elif not isinstance(policy, KVPolicy):
            policy = parse_policy(policy)
        T = len(ids)
        act = [False] * T if actionable is None else [bool(a) for a in actionable]
        if len(act) != T:
            raise RequestError(f"actionable has {len(act)} entries for {T} tokens", "actionable")
        if isinstance(token_ids, TokenTags):
            tags = token_ids
            if actionable is not None:
                tags = dataclasses.replace(tags, actionable=act)
        else:
            code = TagCode.pack(Role.USER, Modality.TEXT, Temporal.CURRENT)
            tags = TokenTags(ids, [code] * T, [0] * T, 0, act, T)
        sid = session_id or f"req:{secrets.token_hex(8)}"
        payload = KVPayload(session_id=sid, policy=policy)
        self._check_length(T, 0)
        t0 = time.perf_counter()
        with self._lock:
            req, logits, info = self._prefill_and_plan(tags, payload)
            try:
                usage = self._usage(req, payload, tags, 0, info, t0)
                prec = self.store.layout.precision(req.slot_map.slots)
            finally:
                self.store.finish_request(req, cache=session_id is not None)
        L, H = self.shape.num_layers, self.shape.num_kv_heads
        prec = prec.view(L, H, T)
        kept = prec != int(Precision.EVICTED)
        return CompressionResult(
            prec, kept, info["forced_mask"], logits.float().cpu(), usage, info["plan"]
        )

    def _calibrate(self) -> None:
        """Measure the model's key channel magnitudes on a fixed conversation once, so the
        store quantizes INT4 keys with per-channel scales (outlier channels)."""
        if not self.store.layout.int4_slots or self.key_channel_scales == "none":
            return
        tags = self._encode(
            CALIBRATION_MESSAGES, None, annotate_messages(CALIBRATION_MESSAGES), True
        )
        if len(tags) > self.kv_capacity:  # a pool too small for it: unit key scales
            return
        payload = KVPayload(session_id=f"req:{secrets.token_hex(8)}", policy=FullCache())
        req, _logits, _info = self._prefill_and_plan(tags, payload)
        try:
            self.store.calibrate_key_channels(req, self.key_channel_scales)
        finally:
            self.store.finish_request(req, cache=False)

    def _sync_time(self) -> float:
        """Wall clock after the device finished queued work (phase timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record(self, usage: KVUsage) -> None:
        """One request's telemetry into the session aggregates and the request log."""
        self.sessions.record(usage)
        self.request_log.append(usage)

    def end_session(self, session_id: str, namespace: str | None = None) -> int:
        """Forget a session: its prefix-cache namespace, method state and metrics.
        ``namespace``: the tenant scope it was served in (see :meth:`prepare_chat`)."""
        scoped = scope_session_id(namespace, session_id)
        with self._lock:
            freed = self.store.end_session(scoped, namespace)
            self.methods.end_session(scoped)
        self.sessions.drop(scoped)
        return freed

    def flush_prefix_cache(self) -> int:
        """Drop the whole prefix cache (every tenant and session namespace, the shared ones
        included; in-flight requests keep their KV). Returns cells freed."""
        with self._lock:
            return self.store.flush_prefix_cache()

    @property
    def kv_capacity(self) -> int:
        """Full-precision KV cells (tokens) one request can ever hold per (layer, KV head):
        the pool less the dead slot."""
        return self.store.allocator.capacity

    # ---------------------------------------------------------------- internals
    def _resolve(self, messages: Sequence[Any], payload: KVPayload | None) -> _Resolved:
        if not messages:
            raise RequestError("messages must not be empty", field="messages")
        try:
            if payload is None:
                session_id = resolve_session_id(messages=messages)
                payload = KVPayload(session_id=session_id, policy=FullCache())
            annotations = payload.messages
            if annotations is None:
                annotations = annotate_messages(messages, node=payload.node)
        except (TypeError, ValueError, AttributeError, KeyError) as e:
            raise RequestError(f"bad messages: {e}", field="messages") from None
        try:
            self.methods.for_policy(payload.policy)
        except ValueError as e:
            field = getattr(e, "field", None) or "payload.policy.method"
            raise RequestError(str(e), field=field) from None
        if len(annotations) != len(messages):
            raise RequestError(
                f"payload has {len(annotations)} message annotations for {len(messages)} messages",
                field="payload.messages",
            )
        return _Resolved(payload, list(annotations))

    def _encode(self, messages, tools, annotations, add_generation_prompt) -> TokenTags:
        try:
            return self.renderer.encode(messages, tools, annotations, add_generation_prompt)
        except (TypeError, ValueError, KeyError) as e:
            raise RequestError(f"cannot render messages: {e}", field="messages") from None
        except Exception as e:  # jinja2 errors from a template
            raise RequestError(f"chat template failed: {e}", field="messages") from None

    def _check_length(self, prompt: int, new: int) -> None:
        if prompt + new > self.max_context:
            raise RequestError(
                f"prompt ({prompt} tokens) + max_tokens ({new}) exceeds the model's context "
                f"({self.max_context})",
                field="messages" if prompt >= self.max_context else "max_tokens",
            )
        if prompt + new > self.kv_capacity:  # admission: it could never fit the KV pool
            raise RequestError(
                f"prompt ({prompt} tokens) + max_tokens ({new}) exceeds the KV pool "
                f"({self.kv_capacity} token slots, --kv-slots)",
                field="messages" if prompt >= self.kv_capacity else "max_tokens",
            )

    def _forward(
        self,
        ids: Sequence[int] | torch.Tensor,
        positions: torch.Tensor,
        cache: StoreCache,
        keep: int,
    ) -> torch.Tensor:
        """Run the model over ``ids`` (a list, or int64 ``[1, n]`` on the device) at
        ``positions``; float32 logits ``[keep, V]``."""
        if isinstance(ids, torch.Tensor):
            input_ids = ids
        else:
            input_ids = torch.tensor([list(ids)], device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions.to(self.device)[None],
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_arg: cache, CACHE_KWARG: cache},
            )
        return out.logits[0].float()

    def _graph_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        kernel: KernelDecode,
        observer: PrefillObserver | None,
    ) -> torch.Tensor:
        """One decode step on the kernels from device tensors only (what
        :class:`DecodeGraph` captures): logits ``[V]``."""
        view = LiveView(self.store, kernel.req)  # (unread on the kernels' path)
        if observer is not None:  # (an eager step's observer may keep them: not the input)
            positions = positions.clone()
        cache = StoreCache(view, positions, write_slots, observer, kernel=kernel, seq_length=0)
        return self._forward(input_ids, positions, cache, keep=1)[-1]

    def _prefill_and_plan(
        self, tags: TokenTags, payload: KVPayload, namespace: str | None = None
    ) -> tuple[RequestKV, torch.Tensor, dict]:
        policy = payload.policy
        method = self.methods.for_policy(policy)
        T = len(tags)
        # A method that observes prefill queries (IntentKV's q-bar over the actionable query)
        # sees only computed positions: never take the actionable query from the prefix cache,
        # or the plan would depend on what other requests happened to cache (a retry, another
        # session with the same opening). With no actionable token, recompute IntentKV's
        # fallback tail window.
        reuse = T
        if method.observes_prefill:
            tail = method.observed_tail(policy)
            reuse = next((i + 1 for i, a in enumerate(tags.actionable) if a), max(T - tail + 1, 1))
        reuse = method.prefix_reuse(policy, payload.session_id, reuse)
        # request-local ids never match again: their holes go to no session namespace
        store_session = None if is_request_local(payload.session_id) else payload.session_id
        req = self.store.begin_request(store_session, tags.token_ids[:reuse], namespace=namespace)
        try:
            actionable = torch.tensor(tags.actionable, dtype=torch.bool)
            observer = method.observer(
                policy, ObserveRequest(T, req.num_cached, actionable, self.shape)
            )
            slots = self.store.extend(req, tags.token_ids[reuse:])
            start = req.num_cached
            logits = None
            view = LiveView(self.store, req)
            for c0 in range(start, T, self.chunk_size):
                c1 = min(c0 + self.chunk_size, T)
                positions = torch.arange(c0, c1)
                cache = StoreCache(view, positions, slots[:, c0 - start : c1 - start], observer)
                logits = self._forward(tags.token_ids[c0:c1], positions, cache, keep=1)[-1]
            assert logits is not None
            t_plan = self._sync_time()
            ctx = PlanContext(
                policy=policy,
                session_id=payload.session_id,
                shape=self.shape,
                seq_len=T,
                live=req.slot_map.resident(),
                forced=torch.tensor(tags.forced(method.protects_system(policy))),
                actionable=actionable,
                tag_codes=torch.tensor(tags.codes, dtype=torch.uint8),
                read_keys=lambda layer: self._read_keys(req, layer),
                observation=observer.result() if observer is not None else None,
            )
            plan = method.plan(ctx)
            info = self._apply(req, plan)
            info["plan_time_s"] = self._sync_time() - t_plan
            info["forced"] = int(ctx.forced.sum())
            info["forced_mask"] = ctx.forced
            info["decode_pruning"] = DecodePruning.for_request(
                self.store, req, method, ctx, observer, info
            )
        except BaseException:
            self.store.finish_request(req, cache=False)
            raise
        return req, logits, info

    def _read_keys(self, req: RequestKV, layer: int):
        k, _v, pos, head_mask = self.store.read_kv(req, layer)
        return k, pos, head_mask

    def _apply(self, req: RequestKV, plan: Plan) -> dict:
        """Evict, then quantize what survives; remember the plan's decode rule."""
        evicted_tokens = evicted_entries = quantized = 0
        if plan.evict is not None and plan.evict.numel():
            res = self.store.evict(req, plan.evict)
            evicted_tokens += res.positions_dead
            evicted_entries += res.entries_evicted
        if plan.keep_mask is not None:
            res = self.store.evict_per_head(req, plan.keep_mask, plan.keep_start)
            evicted_tokens += res.positions_dead
            evicted_entries += res.entries_evicted
        if plan.precision is not None:
            q = self.store.set_precision(req, plan.precision)
            quantized += q.int4 + q.int2
        return {
            "evicted_tokens": evicted_tokens,
            "evicted_entries": evicted_entries,
            "quantized": quantized,
            "compacted": 0,
            "note": plan.note,
            "planned_live": float(req.slot_map.effective_live_tokens()),
            "decode": plan.decode,
            "plan": plan,
            # decode-time quantization starts after the positions the plan decided
            "demote_from": max(req.seq_len - plan.decode.residual, 0) if plan.decode else 0,
        }

    def _demote_tail(self, req: RequestKV, info: dict) -> tuple[int, int] | None:
        """Quantize the oldest full-precision positions outside the residual window, 32 at a
        time (a page), as the plan's :class:`DecodePrecision` says. The positions it covered,
        ``(start, end)``, or None when no page was due."""
        rule: DecodePrecision | None = info["decode"]
        if rule is None:
            return None
        start = info["demote_from"]
        pages = (req.seq_len - rule.residual - start) // 32
        if pages <= 0:
            return None
        prec = torch.full((32 * pages,), int(rule.precision), dtype=torch.int8)
        q = self.store.set_precision(req, prec, int2_leftover="full", start=start)
        info["demote_from"] = start + 32 * pages
        info["quantized"] += q.int4 + q.int2
        return start, start + 32 * pages

    def _decode(
        self, req, logits, gen: GenerationConfig, stream: _ContentStream | None, info: dict
    ) -> tuple[list[int], str, tuple[int, int]]:
        generator = None
        if gen.temperature >= SAMPLING_EPS:  # (sampled where the logits are: no copy to wait for)
            generator = torch.Generator(device=self.device)
            # no seed: a fresh one, without reseeding torch's global generator
            generator.manual_seed(gen.seed if gen.seed is not None else secrets.randbits(63))
        out: list[int] = []
        raw = eff = 0
        finish = "length"
        view = LiveView(self.store, req)
        pruning: DecodePruning | None = info.get("decode_pruning")
        observer = pruning.observer if pruning is not None else None
        kernel = None
        if self.decode_attention != "dense":
            backend = "torch" if self.decode_attention == "reference" else "triton"
            kernel = KernelDecode(self.store, req, gen.max_tokens, backend)
        # (the kernels' steps only: decode_attention may have been switched since __init__)
        on_kernels = kernel is not None and self.decode_attention == "kernels"
        graph = self.decode_graph if on_kernels else None
        if graph is not None:
            graph.begin(kernel, observer)
        # live cells per column: +1 per decode step; recounted only when a plan changes them
        live = req.slot_map.effective_live_tokens()
        # graph steps launch before the host reads the token they feed (sampled on the
        # device from the previous step's logits): the host's work for a step (cells, index,
        # the launch) runs while the GPU computes the step before; a step fed a stop token
        # is dropped again (KVStore.truncate). Same steps, same order on the GPU: same tokens.
        overlap = graph is not None and self.decode_overlap
        ahead: _Launched | None = None  # a step launched on a token not read yet
        fed = False  # a token queued on the device (graph.feed), not read yet
        # the text so far, for the stream and stop strings (a window decoded a step)
        detok = IncrementalText(self.tokenizer) if stream is not None or gen.stop else None

        def launch(tok: int | None) -> _Launched:
            """The step feeding ``tok`` (None: the token ``graph.feed`` queued) at the
            next position; raises OutOfSlots (nothing changed) when the pool is full."""
            pos = req.seq_len
            slots = self.store.extend(req, [_UNREAD if tok is None else tok])
            try:
                if kernel is not None:
                    kernel.append(slots)
                if graph is not None:
                    return _Launched(pos, graph.step(tok, pos, slots), None)
                assert tok is not None
                cache = StoreCache(view, torch.tensor([pos]), slots, observer, kernel=kernel)
                logits = self._forward([tok], torch.tensor([pos]), cache, keep=1)[-1]
            except BaseException:  # (a step that could not launch leaves no position)
                self.store.truncate(req, 1)
                raise
            return _Launched(pos, logits, cache)

        def commit(step: _Launched) -> None:
            """A launched step whose token the host has accepted: the counts, and what
            follows a step (a decode-time page, a pruning pass) in the order eager steps
            have it."""
            nonlocal raw, eff, live, view
            raw += step.pos + 1
            live += 1
            if kernel is not None:
                eff += int(round(live))
            else:
                assert step.cache is not None
                eff += int(round(step.cache.attended_keys / self.shape.num_layers))
            page = self._demote_tail(req, info)  # a page filled: its rows change in views
            evicted = pruning.after_step() if pruning is not None else None
            if evicted is not None:  # (a pruning pass: which cells exist changed)
                live -= evicted.entries / req.slot_map.num_columns
            if page is not None and evicted is not None:  # (both at once: a new view)
                view = LiveView(self.store, req)
            elif page is not None:  # (a page: its rows' values changed)
                view = view.follow_page(*page)
            elif evicted is not None:
                view = view.follow_eviction(evicted.start, evicted.end)
            if kernel is not None and (page is not None or evicted is not None):
                # (the index follows in place; a captured step, its epoch)
                kernel.rebuild(page, evicted.cells if evicted is not None else None)

        try:
            for _ in range(gen.max_tokens):
                if gen.should_stop is not None and gen.should_stop():
                    finish = "abort"
                    break
                if fed:  # (sampled on the device; the GPU computes the step it fed meanwhile)
                    tok, fed = graph.read_fed_token(), False
                    if ahead is not None:
                        req.token_ids[ahead.pos] = tok
                else:
                    tok = self._sample(logits, gen, generator)
                if tok in self._stop_ids and not gen.ignore_eos:
                    finish = "stop"
                    break
                out.append(tok)
                if detok is not None:
                    text = detok.add(tok)
                    if stream is not None:
                        stream.update(text)
                    if gen.stop and any(s and s in text for s in gen.stop):
                        finish = "stop"
                        break
                if len(out) == gen.max_tokens:
                    break
                if ahead is not None:  # (the step feeding tok runs already)
                    step, ahead = ahead, None
                else:
                    try:
                        step = launch(tok)
                    except OutOfSlots:  # the pool ran out: return what was generated
                        break
                commit(step)
                logits = step.logits
                if overlap and len(out) + 1 < gen.max_tokens:  # (a next step is wanted)
                    graph.feed(self._next_token(logits, gen, generator))
                    fed = True  # (read next, launched or not: the same draws as one at a time)
                    with contextlib.suppress(OutOfSlots):  # (full: launched after it is read)
                        ahead = launch(None)
        finally:  # (however it ends: the graph's memory and the observer's buffers go)
            if ahead is not None:  # (a step fed a token that ended the decode: undone)
                torch.cuda.current_stream(self.device).synchronize()  # (it ran to its end)
                self.store.truncate(req, 1)
            if graph is not None:
                graph.end()
            if pruning is not None:
                pruning.finish()
        if kernel is not None:
            info["compacted"] += kernel.compacted
        return out, finish, (raw, eff)

    def _greedy_fork(self, req: RequestKV, logits: torch.Tensor, n_tokens: int) -> list[int]:
        """Greedy continuation of ``req`` whose K/V stays in a private view (store untouched)."""
        view = LiveView(self.store, req)
        out: list[int] = []
        pos = req.seq_len
        for i in range(n_tokens):
            tok = int(torch.argmax(logits))
            if tok in self._stop_ids:
                break
            out.append(tok)
            if i == n_tokens - 1:
                break
            cache = StoreCache(view, torch.tensor([pos]))
            logits = self._forward([tok], torch.tensor([pos]), cache, keep=1)[-1]
            pos += 1
        return out

    def _greedy_check(
        self, req: RequestKV, logits: torch.Tensor, continuation: list[int], n_tokens: int
    ) -> list[int]:
        """Argmax after each prefix of ``continuation`` (at most ``n_tokens`` ids) in one
        teacher-forced pass in a private view (store untouched): ``[len + 1]`` ids, or
        ``[len]`` when ``continuation`` is ``n_tokens`` long (nothing follows it)."""
        ids = continuation[:-1] if len(continuation) == n_tokens else continuation
        all_logits = logits[None].float()
        if ids:
            pos = req.seq_len
            positions = torch.arange(pos, pos + len(ids))
            cache = StoreCache(LiveView(self.store, req), positions)
            step_logits = self._forward(ids, positions, cache, keep=len(ids))
            all_logits = torch.cat([all_logits, step_logits], dim=0)
        return all_logits.argmax(-1).tolist()

    def _greedy_along(self, reference: list[int], check: list[int], n_tokens: int) -> list[int]:
        """What greedy decoding gives, from the argmax ``check`` along ``reference``: the
        reference itself if every argmax agrees (ending at a stop token where it is shorter
        than ``n_tokens``), else the agreeing prefix plus the first differing argmax."""
        for j, tok in enumerate(reference):
            if check[j] != tok:
                return reference[:j] if check[j] in self._stop_ids else [*reference[:j], check[j]]
        if len(reference) < n_tokens and check[len(reference)] not in self._stop_ids:
            return [*reference, check[len(reference)]]
        return reference

    @staticmethod
    def _truncate_at_stop(text: str, gen: GenerationConfig) -> str:
        cut = min((i for s in gen.stop if s and (i := text.find(s)) >= 0), default=len(text))
        return text[:cut]

    @staticmethod
    def _next_token(logits: torch.Tensor, gen: GenerationConfig, generator) -> torch.Tensor:
        """The token sampled from ``logits`` (float32 ``[V]``) as int64 ``[1]`` on their
        device, queued without waiting for it (``generator``: on that device, None when
        greedy)."""
        if gen.temperature < SAMPLING_EPS:  # greedy (as vLLM): logits / 1e-300 is inf, NaN
            return torch.argmax(logits, dim=-1, keepdim=True)
        probs = torch.softmax(logits.float() / gen.temperature, dim=-1)
        if gen.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cut = torch.cumsum(sorted_p, 0) - sorted_p > gen.top_p
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p.masked_fill_(cut, 0))
        # a draw from probs as the first arrival of exponential clocks, argmax(p / E) (as
        # vLLM and SGLang sample on the GPU): no host sync and no device-side assert on a
        # bad distribution, which would end the process's CUDA context (multinomial has
        # both); E kept > 0, so a token cut by top-p can never be drawn
        race = torch.empty_like(probs).exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        return torch.argmax(probs / race, dim=-1, keepdim=True)

    @staticmethod
    def _sample(logits: torch.Tensor, gen: GenerationConfig, generator) -> int:
        return int(Engine._next_token(logits, gen, generator))

    def _stop_token_ids(self) -> set[int]:
        ids = set()
        tok = self.tokenizer
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        for s in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            i = tok.convert_tokens_to_ids(s)
            if isinstance(i, int) and i != tok.unk_token_id and i >= 0:
                ids.add(i)
        return ids

    def _usage(
        self, req, payload: KVPayload, tags: TokenTags, completion: int, plan_info: dict, t0: float
    ) -> KVUsage:
        stats = self.store.request_stats(req)
        T = len(tags)
        return KVUsage(
            method=payload.policy.method,
            policy=payload.policy.describe(),
            session_id=payload.session_id,
            node=payload.node,
            prompt_tokens=T,
            completion_tokens=completion,
            prefix_hit_tokens=req.prefix_hit_tokens,
            prefix_hit_rate=req.prefix_hit_tokens / T if T else 0.0,
            peak_request_tokens=T + completion,
            live_kv_tokens=round(stats.effective_live_tokens, 2),
            live_kv_bytes=stats.effective_bytes,
            resident_kv_tokens=stats.resident_slots,
            resident_kv_bytes=stats.resident_bytes,
            resident_kv_bytes_by_precision=stats.resident_bytes_by_precision,
            quantized_entries=plan_info["quantized"],
            compacted_entries=plan_info["compacted"],
            slot_map_bytes=stats.slot_map_bytes,
            planned_live_kv_tokens=round(plan_info["planned_live"], 2),
            compression_ratio=round(1 - stats.effective_live_tokens / max(stats.seq_len, 1), 4),
            forced_tokens=plan_info["forced"],
            plan_time_s=round(plan_info["plan_time_s"], 5),
            evicted_tokens=plan_info["evicted_tokens"],
            evicted_entries=plan_info["evicted_entries"],
            raw_kv_reads=0,
            effective_kv_reads=0,
            wall_time_s=round(time.perf_counter() - t0, 4),
            plan_note=plan_info["note"],
        )
