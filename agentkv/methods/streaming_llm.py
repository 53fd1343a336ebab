"""StreamingLLM (kvpress ``StreamingLLMPress``): attention sinks + the most recent tokens.

Keeps the first ``sinks`` live positions and the last ``budget - sinks`` live positions;
everything between is evicted (every layer and head).
"""

from __future__ import annotations

import torch

from agentkv.methods.base import Method, Plan, PlanContext, register_method
from agentkv.policies import StreamingLLM


@register_method
class StreamingLLMMethod(Method):
    name = "streamingllm"

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, StreamingLLM)
        live = torch.nonzero(ctx.live).reshape(-1)
        if live.numel() <= policy.budget:
            return Plan(note="below budget: nothing evicted")
        recent = policy.budget - policy.sinks
        evict = live[policy.sinks : live.numel() - recent]
        return Plan(evict=evict)
