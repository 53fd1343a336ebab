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
"""

from __future__ import annotations

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
    topk_positions,
)
from agentkv.methods.query_memory import QueryMemoryStore, normalize
from agentkv.policies import IntentKV, KVPolicy


class QueryMean(PrefillObserver):
    """Accumulates the mean post-RoPE query over the actionable span.

    Fallback, when no actionable token is computed in this request: the mean over the last
    ``window`` computed positions (a bounded tail window: the generation prompt and the end of
    the newest message), never a single token.
    """

    def __init__(self, req: ObserveRequest, window: int = 32):
        s = req.shape
        self.actionable = req.actionable
        self.tail_from = max(req.seq_len - window, req.num_cached)
        self.sum = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)
        self.count = torch.zeros(s.num_layers)
        self.tail_sum = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)
        self.tail_count = torch.zeros(s.num_layers)

    def observe(self, layer, q, q_positions, k, k_positions, head_mask):
        pos = q_positions.cpu()
        sel = self.actionable[pos]
        if bool(sel.any()):
            self.sum[layer] += q[:, sel.to(q.device)].float().sum(dim=1).cpu()
            self.count[layer] += int(sel.sum())
        tail = pos >= self.tail_from
        if bool(tail.any()):
            self.tail_sum[layer] += q[:, tail.to(q.device)].float().sum(dim=1).cpu()
            self.tail_count[layer] += int(tail.sum())

    def result(self) -> torch.Tensor:
        """``q_bar`` float32 ``[L, Hq, D]`` (zeros for a layer that saw no query)."""
        has = self.count > 0
        q_bar = self.tail_sum / self.tail_count.clamp_min(1)[:, None, None]
        q_bar[has] = self.sum[has] / self.count[has][:, None, None]
        return q_bar


@register_method
class IntentKVMethod(Method):
    name = "intentkv"

    def __init__(self, shape: ModelShape, memory_capacity: int = 1024):
        super().__init__(shape)
        self.memory = QueryMemoryStore(memory_capacity)

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        assert isinstance(policy, IntentKV)
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
        scores = self.rule_scores(ctx, probe, candidates) if keep_n > 0 else None
        if scores is None:
            keep = candidates.nonzero().reshape(-1)[:0]
        else:
            keep = topk_positions(scores, candidates, keep_n)
        keep_mask = torch.zeros_like(candidates)
        keep_mask[keep] = True
        evict = torch.nonzero(candidates & ~keep_mask).reshape(-1)
        note = "" if keep_n > 0 else f"forced set ({n_forced}) fills the budget"
        return Plan(evict=evict, scores=scores, note=note)

    def probe(self, ctx: PlanContext, policy: IntentKV) -> torch.Tensor:
        """The scoring query, float32 ``[L, Hq, D]``, unit norm per (layer, head): the updated
        session memory (``memory``) or ``normalize(q_bar)`` (``query``)."""
        q_bar: torch.Tensor = ctx.observation
        if policy.mode == "query":
            return normalize(q_bar.float())
        return self.memory.update(ctx.session_id, q_bar, policy.memory_decay)

    def rule_scores(
        self, ctx: PlanContext, probe: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """float32 ``[T]``: mean over layers and query heads of the softmax over candidates."""
        s = self.shape
        scores = torch.zeros(ctx.seq_len)
        for layer in range(s.num_layers):
            k, positions, head_mask = ctx.read_keys(layer)
            pos = positions.cpu()
            key_mask = candidates[pos]
            if not bool(key_mask.any()):
                continue
            k = k.transpose(0, 1)  # [Hkv, n, D]
            q = probe[layer].to(k.device, k.dtype)[:, None, :]  # [Hq, 1, D]
            probs = attention_probs(q, None, k, None, head_mask, key_mask.to(k.device))
            scores[pos] += probs[:, 0, :].sum(dim=0).cpu()
        return scores / (s.num_layers * s.num_q_heads)

    def end_session(self, session_id: str) -> None:
        self.memory.drop(session_id)
