"""H2O-style heavy hitters (kvpress ``ObservedAttentionPress``) + a recent window.

Per layer: prefill attention summed over the queries computed in this request, each key's
sum divided by the number of those queries that can see it, mean over the GQA group ->
one score per KV head and position. The last ``recent`` live positions are always kept
(at most ``budget`` of them); each (layer, KV head) keeps its top ``budget - recent`` other
positions among those it still holds. Keys reused from the prefix cache are scored by the new
queries only (they are not recomputed).
"""

from __future__ import annotations

import torch

from agentkv.methods.attention_probe import AttentionColumnSums
from agentkv.methods.base import (
    Method,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
    register_method,
)
from agentkv.policies import H2O, KVPolicy


@register_method
class H2OMethod(Method):
    name = "h2o"
    observes_prefill = True

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        return AttentionColumnSums(req)

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, H2O)
        obs: AttentionColumnSums = ctx.observation
        T, s = ctx.seq_len, self.shape
        live = ctx.live
        if int(live.sum()) <= policy.budget:
            return Plan(note="below budget: nothing evicted")
        live_idx = torch.nonzero(live).reshape(-1)
        n_recent = min(policy.recent, policy.budget)
        recent = torch.zeros(T, dtype=torch.bool)
        recent[live_idx[live_idx.numel() - n_recent :]] = True
        budget_rest = policy.budget - n_recent
        # ranked on the observed device, positions picked on the host: the keep mask and the
        # scores are the plan's only reads
        dev = obs.sums.device
        score = obs.sums / obs.counts.clamp_min(1)[:, None, :]  # [L, Hq, T]
        score = score.view(s.num_layers, s.num_kv_heads, s.group, T).mean(dim=2)
        keep = torch.zeros(s.num_layers, s.num_kv_heads, T, dtype=torch.bool, device=dev)
        keep[:, :, torch.nonzero(recent).reshape(-1).to(dev)] = True
        idx = torch.nonzero(live & ~recent).reshape(-1).to(dev)
        k = min(budget_rest, idx.numel())
        if k > 0:
            held = obs.head_live[:, :, idx]
            ranked = score[:, :, idx].masked_fill(~held, float("-inf"))
            top = torch.topk(ranked, k, dim=-1).indices  # [L, Hkv, k]
            keep.scatter_(2, idx[top], held.gather(2, top))
        return Plan(keep_mask=keep.cpu(), scores=score.cpu())
