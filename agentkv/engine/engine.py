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

import dataclasses
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentkv.annotation import MessageAnnotation, annotate_messages
from agentkv.cache import DEAD, KVStore, RequestKV
from agentkv.engine.chat_template import ChatRenderer
from agentkv.engine.decode_pruning import DecodePruning
from agentkv.engine.model_loader import load_model
from agentkv.engine.store_cache import CACHE_KWARG, LiveView, StoreCache
from agentkv.engine.telemetry import KVUsage, SessionMetrics
from agentkv.engine.tool_calls import parse_tool_calls
from agentkv.methods import Method, MethodSet, ModelShape, ObserveRequest, Plan, PlanContext
from agentkv.policies import FullCache
from agentkv.session import is_request_local, resolve_session_id
from agentkv.token_tagger import TokenTags
from agentkv.wire import KVPayload


class RequestError(ValueError):
    """A request the engine cannot serve as given (maps to HTTP 400). ``field`` names where."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


DEFAULT_MAX_TOKENS = 256


@dataclass
class GenerationConfig:
    """Decoding settings. ``max_tokens=None``: up to :data:`DEFAULT_MAX_TOKENS`, fewer when
    the context has less room left (a long prompt alone is not an error)."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


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
            stopping early at an end-of-turn token.
    """

    target_ids: torch.Tensor
    logits: torch.Tensor
    usage: KVUsage
    greedy_ids: list[int] = field(default_factory=list)


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


TOOL_CALL_OPEN = "<tool_call>"


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
        i = safe.find(TOOL_CALL_OPEN)
        if i >= 0:
            safe = safe[:i]
        else:
            safe = safe[: len(safe) - self._held_suffix(safe, TOOL_CALL_OPEN)]
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
        model: local HF model directory, or None for the default SmolLM2-135M-Instruct.
        device: ``"cpu"``, ``"cuda"``, ... (default: CUDA when available).
        dtype: model and KV dtype (default float32 on CPU, bfloat16 on CUDA).
        kv_slots: KV pool rows (tokens), the dead slot included.
        chunk_size: prefill chunk (tokens).
    """

    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kv_slots: int = 32768,
        chunk_size: int = 512,
    ):
        self.model, self.tokenizer = load_model(model, device, dtype)
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.model_name = str(model) if model else "SmolLM2-135M-Instruct"
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = ModelShape(
            num_layers=cfg.num_hidden_layers,
            num_q_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
        )
        self.max_context = int(getattr(cfg, "max_position_embeddings", 8192))
        self.store = KVStore(
            self.shape.num_layers,
            self.shape.num_kv_heads,
            head_dim,
            kv_slots,
            dtype=self.dtype,
            device=self.device,
        )
        self.methods = MethodSet(self.shape)
        self.renderer = ChatRenderer(self.tokenizer)
        self.chunk_size = chunk_size
        self.sessions = SessionMetrics()
        #: the most recent requests' telemetry, oldest first.
        self.request_log: deque[KVUsage] = deque(maxlen=10000)
        self._lock = threading.Lock()
        self._stop_ids = self._stop_token_ids()

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
    ) -> PreparedChat:
        """Validate, render and tag a chat request; raises :class:`RequestError` on bad input."""
        gen = gen or GenerationConfig()
        resolved = self._resolve(messages, payload)
        tags = self._encode(messages, tools, resolved.annotations, add_generation_prompt=True)
        if gen.max_tokens is None:
            room = max(self.max_context - len(tags), 1)  # no room at all: the check says so
            gen = dataclasses.replace(gen, max_tokens=min(DEFAULT_MAX_TOKENS, room))
        self._check_length(len(tags), gen.max_tokens)
        return PreparedChat(resolved.payload, tags, gen)

    def run_chat(
        self, prepared: PreparedChat, on_text: Callable[[str], None] | None = None
    ) -> ChatResult:
        """Prefill, plan and decode a :class:`PreparedChat` (see :meth:`chat`)."""
        payload, tags, gen = prepared.payload, prepared.tags, prepared.gen
        stream = None if on_text is None else _ContentStream(on_text, gen.stop)
        t0 = time.perf_counter()
        with self._lock:
            req, logits, plan_info = self._prefill_and_plan(tags, payload)
            try:
                out_ids, finish, (raw, eff) = self._decode(
                    req, logits, gen, stream, plan_info["decode_pruning"]
                )
                usage = self._usage(req, payload, tags, len(out_ids), plan_info, t0)
            finally:
                self.store.finish_request(req, cache=True)
        usage = usage.model_copy(update={"raw_kv_reads": raw, "effective_kv_reads": eff})
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
    ) -> ScoreResult:
        """Teacher-force ``target`` (an assistant message) after ``messages``.

        The context is held as the policy leaves it after prefill (evictions applied); the
        target's tokens then attend to it, as decode steps would. With ``greedy_tokens > 0``,
        the model first continues greedily from the same state for that many tokens in a fork
        that writes nothing to the store (``ScoreResult.greedy_ids``). The prompt and target
        are cached for the session's next turn.
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
                greedy = self._greedy_fork(req, logits, greedy_tokens) if greedy_tokens else []
                positions = torch.arange(n, n + len(target_ids) - 1)
                if positions.numel():
                    slots = self.store.extend(req, target_ids[:-1])
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
        return ScoreResult(torch.tensor(target_ids), all_logits.float().cpu(), usage, greedy)

    def _record(self, usage: KVUsage) -> None:
        """One request's telemetry into the session aggregates and the request log."""
        self.sessions.record(usage)
        self.request_log.append(usage)

    def end_session(self, session_id: str) -> int:
        """Forget a session: its prefix-cache namespace, method state and metrics."""
        with self._lock:
            freed = self.store.end_session(session_id)
            self.methods.end_session(session_id)
        self.sessions.drop(session_id)
        return freed

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
        except (TypeError, ValueError) as e:
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

    def _forward(
        self, ids: Sequence[int], positions: torch.Tensor, cache: StoreCache, keep: int
    ) -> torch.Tensor:
        """Run the model over ``ids`` at ``positions``; float32 logits ``[keep, V]``."""
        input_ids = torch.tensor([list(ids)], device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids,
                position_ids=positions.to(self.device)[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep,
                **{CACHE_KWARG: cache},
            )
        return out.logits[0].float()

    def _prefill_and_plan(
        self, tags: TokenTags, payload: KVPayload
    ) -> tuple[RequestKV, torch.Tensor, dict]:
        policy = payload.policy
        method = self.methods.for_policy(policy)
        T = len(tags)
        # A method that observes prefill queries (IntentKV's q-bar over the actionable query)
        # sees only computed positions: never take the actionable query from the prefix cache,
        # or the plan would depend on what other requests happened to cache (a retry, another
        # session with the same opening).
        reuse = T
        if type(method).observer is not Method.observer:
            reuse = next((i + 1 for i, a in enumerate(tags.actionable) if a), T)
        reuse = method.prefix_reuse(policy, payload.session_id, reuse)
        # request-local ids never match again: their holes go to no session namespace
        store_session = None if is_request_local(payload.session_id) else payload.session_id
        req = self.store.begin_request(store_session, tags.token_ids[:reuse])
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
                cache = StoreCache(view, positions, slots[c0 - start : c1 - start], observer)
                logits = self._forward(tags.token_ids[c0:c1], positions, cache, keep=1)[-1]
            assert logits is not None
            ctx = PlanContext(
                policy=policy,
                session_id=payload.session_id,
                shape=self.shape,
                seq_len=T,
                live=(req.slot_map.slots != DEAD).cpu(),
                forced=torch.tensor(tags.forced(getattr(policy, "protect_system", True))),
                actionable=actionable,
                tag_codes=torch.tensor(tags.codes, dtype=torch.uint8),
                read_keys=lambda layer: self._read_keys(req, layer),
                observation=observer.result() if observer is not None else None,
            )
            plan = method.plan(ctx)
            info = self._apply(req, plan)
            info["forced"] = int(ctx.forced.sum())
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
        evicted_tokens = evicted_entries = 0
        if plan.evict is not None and plan.evict.numel():
            res = self.store.evict(req, plan.evict)
            evicted_tokens += res.positions_dead
            evicted_entries += res.entries_evicted
        if plan.keep_mask is not None:
            res = self.store.evict_per_head(req, plan.keep_mask)
            evicted_tokens += res.positions_dead
            evicted_entries += res.entries_evicted
        return {
            "evicted_tokens": evicted_tokens,
            "evicted_entries": evicted_entries,
            "note": plan.note,
            "planned_live": float(req.slot_map.effective_live_tokens()),
        }

    def _decode(
        self,
        req,
        logits,
        gen: GenerationConfig,
        stream: _ContentStream | None,
        pruning: DecodePruning | None = None,
    ) -> tuple[list[int], str, tuple[int, int]]:
        generator = None
        if gen.temperature > 0:
            generator = torch.Generator(device="cpu")
            # no seed: a fresh one, without reseeding torch's global generator
            generator.manual_seed(gen.seed if gen.seed is not None else secrets.randbits(63))
        out: list[int] = []
        raw = eff = 0
        finish = "length"
        view = LiveView(self.store, req)
        for _ in range(gen.max_tokens):
            tok = self._sample(logits, gen, generator)
            if tok in self._stop_ids:
                finish = "stop"
                break
            out.append(tok)
            if stream is not None or gen.stop:
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                if stream is not None:
                    stream.update(text)
                if gen.stop and any(s and s in text for s in gen.stop):
                    finish = "stop"
                    break
            if len(out) == gen.max_tokens:
                break
            pos = req.seq_len
            slots = self.store.extend(req, [tok])
            observer = pruning.observer if pruning is not None else None
            cache = StoreCache(view, torch.tensor([pos]), slots, observer)
            logits = self._forward([tok], torch.tensor([pos]), cache, keep=1)[-1]
            raw += pos + 1
            eff += int(round(cache.attended_keys / self.shape.num_layers))
            if pruning is not None:
                view = pruning.after_step(view)
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

    @staticmethod
    def _truncate_at_stop(text: str, gen: GenerationConfig) -> str:
        cut = min((i for s in gen.stop if s and (i := text.find(s)) >= 0), default=len(text))
        return text[:cut]

    @staticmethod
    def _sample(logits: torch.Tensor, gen: GenerationConfig, generator) -> int:
        if gen.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / gen.temperature, dim=-1)
        if gen.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cut = torch.cumsum(sorted_p, 0) - sorted_p > gen.top_p
            sorted_p[cut] = 0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return int(torch.multinomial(probs, 1, generator=generator))

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
        bpt = self.store.pool.bytes_per_token
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
            live_kv_bytes=int(stats.effective_live_tokens * bpt),
            resident_kv_tokens=stats.resident_slots,
            resident_kv_bytes=stats.resident_bytes,
            planned_live_kv_tokens=round(plan_info["planned_live"], 2),
            compression_ratio=round(1 - stats.effective_live_tokens / max(stats.seq_len, 1), 4),
            forced_tokens=plan_info["forced"],
            evicted_tokens=plan_info["evicted_tokens"],
            evicted_entries=plan_info["evicted_entries"],
            raw_kv_reads=0,
            effective_kv_reads=0,
            wall_time_s=round(time.perf_counter() - t0, 4),
            plan_note=plan_info["note"],
        )
