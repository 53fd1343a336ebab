"""SnapKV (kvpress ``SnapKVPress``): observation-window attention, pooled, top-k per KV head.

Per layer: the last ``window`` prompt queries (post-RoPE) attend over all keys (causal);
keep the part over keys before the window; mean over the window queries; ``avg_pool1d``
(``kernel``, padding ``kernel // 2``, stride 1, zero padding counted in the average, as
kvpress calls it) along the key sequence; mean over the query heads of each GQA group -> one
score per KV head and position. Window positions are always kept; each (layer, KV head) keeps
its top ``budget - window`` other positions among those it still holds. A window longer than
the budget keeps only its most recent ``budget`` positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentkv.methods.attention_probe import AttentionColumnSums
from agentkv.methods.base import (
    Method,
    ObserveRequest,
    Plan,
    PlanContext,
    PrefillObserver,
    register_method,
)
from agentkv.policies import KVPolicy, SnapKV


@register_method
class SnapKVMethod(Method):
    name = "snapkv"
    observes_prefill = True

    def observer(self, policy: KVPolicy, req: ObserveRequest) -> PrefillObserver | None:
        assert isinstance(policy, SnapKV)
        new = req.seq_len - req.num_cached
        window = max(1, min(policy.window, new))
        return AttentionColumnSums(req, first_query=req.seq_len - window)

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, SnapKV)
        obs: AttentionColumnSums = ctx.observation
        T, s = ctx.seq_len, self.shape
        live = ctx.live
        if int(live.sum()) <= policy.budget:
            return Plan(note="below budget: nothing evicted")
        window_idx = torch.nonzero(live & (torch.arange(T) >= obs.first_query)).reshape(-1)
        kept_window = window_idx[max(window_idx.numel() - policy.budget, 0) :]
        in_window = torch.zeros(T, dtype=torch.bool)
        in_window[window_idx] = True
        budget_rest = policy.budget - kept_window.numel()
        # the sums stay on the observed device; the host reads which keys each layer saw (one
        # [L, T] read), picks each layer's candidates, and reads the keep mask back at the end
        dev = obs.sums.device
        seen = obs.seen.cpu()  # bool [L, T]
        mean = obs.sums / max(T - obs.first_query, 1)  # [L, Hq, T], mean over the window
        keep = torch.zeros(s.num_layers, s.num_kv_heads, T, dtype=torch.bool, device=dev)
        keep[:, :, kept_window.to(dev)] = True
        scores_all = torch.zeros(s.num_layers, s.num_kv_heads, T, device=dev)
        for layer in range(s.num_layers):
            idx = torch.nonzero(live & ~in_window & seen[layer]).reshape(-1).to(dev)
            if idx.numel() == 0:
                continue
            per_kv = self.layer_scores(mean[layer], idx, policy)  # [Hkv, n]
            scores_all[layer][:, idx] = per_kv
            k = min(budget_rest, idx.numel())
            if k > 0:
                held = obs.head_live[layer][:, idx]
                ranked = per_kv.masked_fill(~held, float("-inf"))
                top = torch.topk(ranked, k, dim=-1).indices  # [Hkv, k]
                keep[layer].scatter_(1, idx[top], held.gather(1, top))
        return Plan(keep_mask=keep.cpu(), scores=scores_all.cpu())

    def layer_scores(self, mean: torch.Tensor, idx: torch.Tensor, policy: SnapKV) -> torch.Tensor:
        """One layer's scores float32 ``[Hkv, n]`` of the candidate keys ``idx`` (int64
        ``[n]``, ascending) from the window's mean attention ``mean [Hq, T]``: pooled along
        the candidates, then averaged over each GQA group."""
        s = self.shape
        pooled = F.avg_pool1d(
            mean[:, idx][None], policy.kernel, stride=1, padding=policy.kernel // 2
        )[0]  # [Hq, n]
        return pooled.view(s.num_kv_heads, s.group, -1).mean(dim=1)
