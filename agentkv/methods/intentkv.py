"""IntentKV Phase-1: session QueryMemory + rule score; keep forced set + top-``budget`` history.

Once per request after prefill, when the compressible history exceeds the budget:

1. Forced set ``F`` = actionable query span ∪ generation-prompt tail ∪ protected prefix
   (``protect_system``). Candidates ``C`` = live positions minus ``F``.
2. ``q_bar [L, Hq, D]`` = mean post-RoPE query over the actionable span (computed in this
   prefill); the session memory ``m <- normalize(beta * m + (1 - beta) * q_bar)``.
3. Rule score ``s_i = 1/(L Hq) sum_l sum_h softmax_{j in C}(m[l,h] . K[l, h/g, j] / sqrt(D))_i``
   (mode ``query`` scores with ``q_bar`` instead of ``m``).
4. Keep ``F ∪ top-B(C)``; the rest is evicted (every layer and head) by slot-map redirect.
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
from agentkv.methods.query_memory import QueryMemoryStore
from agentkv.policies import IntentKV, KVPolicy


class _QueryMean(PrefillObserver):
    """Accumulates the mean post-RoPE query over the actionable span (fallback: the last
    computed position, when no actionable token was computed in this request)."""

    def __init__(self, req: ObserveRequest):
        s = req.shape
        self.actionable = req.actionable
        self.last = req.seq_len - 1
        self.sum = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)
        self.count = torch.zeros(s.num_layers)
        self.fallback = torch.zeros(s.num_layers, s.num_q_heads, s.head_dim)

    def observe(self, layer, q, q_positions, k, k_positions, head_mask):
        pos = q_positions.cpu()
        sel = self.actionable[pos]
        if bool(sel.any()):
            self.sum[layer] += q[:, sel.to(q.device)].float().sum(dim=1).cpu()
            self.count[layer] += int(sel.sum())
        if int(pos[-1]) == self.last:
            self.fallback[layer] = q[:, -1].float().cpu()

    def result(self) -> torch.Tensor:
        """``q_bar`` float32 ``[L, Hq, D]``."""
        has = self.count > 0
        q_bar = self.fallback.clone()
        q_bar[has] = self.sum[has] / self.count[has][:, None, None]
        return q_bar


@register_method
class IntentKVMethod(Method):
    name = "intentkv"
    observes_prefill = True

    def protects_system(self, policy: KVPolicy) -> bool:
        assert isinstance(policy, IntentKV)
        return policy.protect_system

    def __init__(self, shape: ModelShape, memory_capacity: int = 1024):
        super().__init__(shape)
        self.memory = QueryMemoryStore(memory_capacity)

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        return _QueryMean(req)

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, IntentKV)
        q_bar: torch.Tensor = ctx.observation
        m = self.memory.update(ctx.session_id, q_bar, policy.memory_decay)
        probe = m if policy.mode == "memory" else q_bar
        candidates = ctx.live & ~ctx.forced
        n_cand = int(candidates.sum())
        if n_cand <= policy.budget:
            return Plan(note=f"history {n_cand} <= budget {policy.budget}: nothing evicted")
        scores = self.rule_scores(ctx, probe, candidates)
        keep = topk_positions(scores, candidates, policy.budget)
        keep_mask = torch.zeros_like(candidates)
        keep_mask[keep] = True
        evict = torch.nonzero(candidates & ~keep_mask).reshape(-1)
        return Plan(evict=evict, scores=scores)

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
