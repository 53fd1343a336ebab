"""IntentKV Phase-1: session QueryMemory + rule score; keep the forced set + the best history.

Once per request after prefill (../shared/methods/NOTES.md, IntentKV):

1. Forced set ``F`` = actionable query span ∪ generation-prompt tail ∪ protected prefix
   (``protect_system``), as the engine hands it over in :class:`PlanContext`. Candidates
   ``C`` = live positions minus ``F``.
2. Skip test. ``budget_scope="total"`` (default, the paper's "residual budget"): nothing to
   do when ``|live| <= B``; else keep ``F`` and the top ``max(B - |F|, 0)`` of ``C``, so the
   request holds ``max(B, |F|)`` live tokens. ``"history"``: nothing to do when
   ``|C| <= B``; else keep ``F`` and the top ``B`` of ``C`` (``B`` on top of ``F``).
3. Only in a compression event (past the skip test): ``q_bar [L, Hq, D]`` = mean post-RoPE
   query over the actionable span computed in this prefill (none computed: over the last
   ``fallback_window`` computed positions); mode ``memory`` folds it into the session memory
   ``m <- normalize(beta m + (1 - beta) normalize(q_bar))`` and scores with ``m``; mode
   ``query`` scores with ``normalize(q_bar)`` and leaves the memory alone.
4. Rule score ``s_i = 1/(L Hq) sum_l sum_h softmax_{j in C}(p[l,h] . K[l, h/g, j] / sqrt(D))_i``
   with the probe ``p`` of step 3 (unit norm per layer and head in both modes, so the modes
   differ by the memory only, not by the softmax temperature). The rest of ``C`` is evicted
   (every layer and head) by slot-map redirect.
5. Mode ``learned`` (Phase-2) ranks by ``s~ = log(|C| s) + alpha MLP(...)`` of the residual
   head (:mod:`agentkv.methods.intentkv_head`) on top of the memory rule score, ``alpha``
   clipped to ``[0, alpha_max]`` (the policy's, else the head's calibrated value, else 1).
   The paper's ablations (``ablate``): ``memory`` scores with ``normalize(q_bar)`` in place of
   the memory (rule and head), ``cross_attention`` forces the head's readout ``c = 0``,
   ``rule`` ranks by ``alpha MLP(...)`` alone (head only); ``alpha_max=0`` is rule only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentkv.methods.attention_probe import attention_probs
from agentkv.methods.base import (
    Method,
    ModelShape,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
    register_method,
    topk_mask,
)
from agentkv.methods.intentkv_head import ResidualHead, head_for, rule_logit
from agentkv.methods.query_memory import QueryMemoryStore, normalize
from agentkv.policies import IntentKV, KVPolicy


class QueryMean(PrefillObserver):
    """Accumulates the mean post-RoPE query over the actionable span.

    Fallback, when no actionable token is computed in this request: the mean over the last
    ``window`` computed positions (a bounded tail window: the generation prompt and the end of
    the newest message), never a single token.

    The sums live on the queries' device while observing (masked sums: no host read per
    layer, which on a GPU would stall the prefill); :meth:`result` reads ``q_bar`` back once.
    """

    reads_keys = False  # the queries only
    sums_queries = True  # two sums: the actionable span's and the tail window's

    def __init__(self, req: ObserveRequest, window: int = 32):
        s = req.shape
        self.actionable = req.actionable
        self.tail_from = max(req.seq_len - window, req.num_cached)
        self.sum = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)
        self.count = torch.zeros(s.num_layers)
        self.tail_sum = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)
        self.tail_count = torch.zeros(s.num_layers)
        self._act = self.actionable  # the actionable flags on the observed device

    def observe(self, layer, q, q_positions, k, k_positions, head_mask):
        self._move(q.device)
        pos = q_positions.to(q.device)
        sel = self._act[pos]  # bool [n], actionable
        tail = pos >= self.tail_from
        for rows, total, count in (
            (sel, self.sum, self.count),
            (tail, self.tail_sum, self.tail_count),
        ):
            # q [Hq, n, D] times a 0/1 row weight is exact in q's dtype; summed in float32
            total[layer] += (q * rows.to(q.dtype)[None, :, None]).sum(dim=1, dtype=torch.float32)
            count[layer] += rows.sum()

    def query_sum_masks(self, q_positions: torch.Tensor) -> torch.Tensor:
        """bool ``[2, n]``: the rows of the actionable span, the rows of the tail window."""
        return torch.stack((self.actionable[q_positions], q_positions >= self.tail_from))

    def add_query_sums(self, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """``sums [L, 2, Hq, D]`` float32 (:meth:`query_sum_masks`' order), ``counts [2]``."""
        self._move(sums.device, flags=False)
        self.sum += sums[:, 0]
        self.tail_sum += sums[:, 1]
        self.count += float(counts[0])
        self.tail_count += float(counts[1])

    def _move(self, device: torch.device, flags: bool = True) -> None:
        """The sums (and, with ``flags``, the actionable flags) to ``device``; before the
        first observation the sums are made there as zeros (a copy of host zeros would make
        the host wait for the device's queue)."""
        if self.sum.device != device:
            bufs = (self.sum, self.count, self.tail_sum, self.tail_count)
            fresh = self.sum.device.type == "cpu" and not bool(
                self.count.any() or self.tail_count.any()
            )
            self.sum, self.count, self.tail_sum, self.tail_count = (
                torch.zeros_like(t, device=device) if fresh else t.to(device) for t in bufs
            )
        if flags and self._act.device != device:
            self._act = self.actionable.to(device)

    def result(self) -> torch.Tensor:
        """``q_bar`` float32 ``[L, Hq, D]`` on the CPU (zeros for a layer that saw no query):
        computed where the sums are, then read back once."""
        has = (self.count > 0)[:, None, None]
        span = self.sum / self.count.clamp_min(1)[:, None, None]
        tail = self.tail_sum / self.tail_count.clamp_min(1)[:, None, None]
        return torch.where(has, span, tail).cpu()


@dataclass
class ScoringEvent:
    """One compression event's inputs and rule scores (what Phase-2 trains on).

    Attributes:
        ctx: the plan context.
        probe: float32 ``[L, Hq, D]``, the scoring query (memory or normalised ``q_bar``).
        candidates: bool ``[T]``.
        scores: float32 ``[T]`` rule scores (softmax mass over the candidates).
        key_means: float32 ``[T, D]``, post-RoPE key of each live position averaged over
            layers and KV heads (zeros where not live).
    """

    ctx: PlanContext
    probe: torch.Tensor
    candidates: torch.Tensor
    scores: torch.Tensor
    key_means: torch.Tensor


class _ScoreSums:
    """The rule score's sums over layers, on the keys' device (no host read).

    Attributes:
        scores: float32 ``[T]``, softmax mass over the candidates summed over layers and
            query heads.
        ksum: float32 ``[T, D]``, keys averaged over KV heads, summed over the layers that
            hold the position (None unless key means are wanted).
        kcount: float32 ``[T]``, those layers' count (None likewise).
    """

    def __init__(
        self,
        seq_len: int,
        head_dim: int,
        probe: torch.Tensor,
        candidates: torch.Tensor,
        device: torch.device,
        key_means: bool,
    ):
        self.probe = probe.to(device)  # float32 [L, Hq, D]
        self.candidates = candidates.to(device)  # bool [T]
        self.scores = torch.zeros(seq_len, device=device)
        self.ksum = torch.zeros(seq_len, head_dim, device=device) if key_means else None
        self.kcount = torch.zeros(seq_len, device=device) if key_means else None

    def add_layer(
        self,
        layer: int,
        k: torch.Tensor,
        positions: torch.Tensor,
        head_mask: torch.Tensor | None,
    ) -> None:
        """Add one layer: ``k [n, Hkv, D]`` post-RoPE keys at int64 ``positions [n]``,
        ``head_mask`` bool ``[Hkv, n]`` or None (:data:`~agentkv.methods.base.KeyReader`).
        A layer holding no candidate adds zeros (its softmax rows are all masked)."""
        pos = positions.to(self.scores.device)
        if self.ksum is not None and self.kcount is not None:
            self.ksum[pos] += k.float().mean(dim=1)
            self.kcount[pos] += 1
        kt = k.transpose(0, 1)  # [Hkv, n, D]
        q = self.probe[layer].to(kt.dtype)[:, None, :]  # [Hq, 1, D]
        probs = attention_probs(q, None, kt, None, head_mask, self.candidates[pos])
        self.scores[pos] += probs[:, 0, :].sum(dim=0)

    def key_means(self) -> torch.Tensor | None:
        """float32 ``[T, D]`` (zeros where no layer holds the position), or None."""
        if self.ksum is None or self.kcount is None:
            return None
        return self.ksum / self.kcount.clamp_min(1)[:, None]


@register_method
class IntentKVMethod(Method):
    name = "intentkv"
    observes_prefill = True

    def protects_system(self, policy: KVPolicy) -> bool:
        assert isinstance(policy, IntentKV)
        return policy.protect_system

    def observed_tail(self, policy: KVPolicy) -> int:
        assert isinstance(policy, IntentKV)
        return policy.fallback_window

    def __init__(self, shape: ModelShape, memory_capacity: int = 1024):
        super().__init__(shape)
        self.memory = QueryMemoryStore(memory_capacity)
        self._head: ResidualHead | None = None
        #: called with every compression event that scores (Phase-2 training data)
        self.recorder: Callable[[ScoringEvent], None] | None = None

    def head(self) -> ResidualHead:
        """The residual head for this model (loaded once; :class:`HeadNotFound` if none)."""
        if self._head is None:
            self._head = head_for(self.shape)
        return self._head

    def use_head(self, head: ResidualHead | None) -> None:
        """Score ``mode="learned"`` with ``head`` (None: look the model's head up again), e.g.
        a head being calibrated before it is written."""
        self._head = head

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        assert isinstance(policy, IntentKV)
        if policy.mode == "learned":
            self.head()  # fail before the prefill, naming the command that makes a head
        return QueryMean(req, policy.fallback_window)

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, IntentKV)
        live = ctx.live
        candidates = live & ~ctx.forced
        n_live, n_cand = int(live.sum()), int(candidates.sum())
        n_forced = n_live - n_cand
        if policy.budget_scope == "total":
            if n_live <= policy.budget:
                return Plan(note=f"live {n_live} <= budget {policy.budget}: nothing evicted")
            keep_n = max(policy.budget - n_forced, 0)
        else:
            if n_cand <= policy.budget:
                return Plan(note=f"history {n_cand} <= budget {policy.budget}: nothing evicted")
            keep_n = policy.budget
        # a compression event: only now does the session memory move
        probe = self.probe(ctx, policy)
        scores = None
        if keep_n > 0:
            want_keys = policy.mode == "learned" or self.recorder is not None
            scores, key_means = self.rule_scores(ctx, probe, candidates, want_keys)
            if want_keys:  # the recorder and the head take host tensors: one read each
                scores, key_means = scores.cpu(), None if key_means is None else key_means.cpu()
            if self.recorder is not None:
                self.recorder(ScoringEvent(ctx, probe, candidates, scores, key_means))
            if policy.mode == "learned":
                scores = self.learned_scores(ctx, policy, probe, candidates, scores, key_means)
        keep = torch.zeros_like(candidates)
        if scores is not None:  # top-k where the scores are; the host reads the mask once
            keep = topk_mask(scores, candidates.to(scores.device), keep_n).cpu()
            scores = scores.cpu()
        evict = torch.nonzero(candidates & ~keep).reshape(-1)
        note = "" if keep_n > 0 else f"forced set ({n_forced}) fills the budget"
        return Plan(evict=evict, scores=scores, note=note)

    def probe(self, ctx: PlanContext, policy: IntentKV) -> torch.Tensor:
        """The scoring query, float32 ``[L, Hq, D]``, unit norm per (layer, head): the updated
        session memory (``memory``, ``learned``) or ``normalize(q_bar)`` (``query``, and
        ``learned`` with ``ablate="memory"``: the memory is neither read nor moved)."""
        q_bar: torch.Tensor = ctx.observation
        if policy.mode == "query" or policy.ablate == "memory":
            return normalize(q_bar.float())
        return self.memory.update(ctx.session_id, q_bar, policy.memory_decay)

    def rule_scores(
        self,
        ctx: PlanContext,
        probe: torch.Tensor,
        candidates: torch.Tensor,
        key_means: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rule scores float32 ``[T]`` (mean over layers and query heads of the softmax over
        candidates) and, with ``key_means``, float32 ``[T, D]`` keys averaged over layers and
        KV heads (the mean over GQA-expanded heads is the same).

        Both stay on the keys' device (``ctx.read_keys``): the sums are accumulated there
        layer by layer, with the probe and the candidate mask moved there once, so scoring
        reads nothing back to the host (on a GPU a read per layer would stall the stream).
        """
        s = self.shape
        acc: _ScoreSums | None = None
        for layer in range(s.num_layers):
            k, positions, head_mask = ctx.read_keys(layer)
            if acc is None:
                acc = _ScoreSums(ctx.seq_len, s.head_dim, probe, candidates, k.device, key_means)
            acc.add_layer(layer, k, positions, head_mask)
        assert acc is not None, "a model has at least one layer"
        return acc.scores / (s.num_layers * s.num_q_heads), acc.key_means()

    def learned_scores(
        self,
        ctx: PlanContext,
        policy: IntentKV,
        probe: torch.Tensor,
        candidates: torch.Tensor,
        scores: torch.Tensor,
        key_means: torch.Tensor | None,
    ) -> torch.Tensor:
        """float32 ``[T]``: ``s~`` on the candidates (``-inf`` elsewhere)."""
        assert key_means is not None
        idx = torch.nonzero(candidates).reshape(-1)
        span = torch.nonzero(ctx.actionable & ctx.live).reshape(-1)
        head = self.head()
        with torch.no_grad():
            s_tilde = head(
                rule_logit(scores[idx]),
                key_means[idx],
                probe.mean(dim=(0, 1)),
                key_means[span],
                alpha_max=head.inference_alpha_max(policy.alpha_max),
                cross_attention=policy.ablate != "cross_attention",
                with_rule=policy.ablate != "rule",
            )
        out = torch.full((ctx.seq_len,), float("-inf"))
        out[idx] = s_tilde
        return out

    def end_session(self, session_id: str) -> None:
        self.memory.drop(session_id)
