"""UniformQuant (KIVI-style): every token quantized to ``bits``, but the most recent
``residual`` tokens, which stay at full precision.

The plan quantizes the live positions before the residual window (INT2: in pages of 32 per
column, the remainder at INT4); decode steps keep appending at full precision and quantize
the oldest 32 once more than ``residual`` tokens are at full precision. Nothing is evicted.
"""

from __future__ import annotations

import torch

from agentkv.cache.precision import Precision
from agentkv.methods.base import DecodePrecision, Method, Plan, PlanContext, register_method
from agentkv.policies import UniformQuant


@register_method
class UniformQuantMethod(Method):
    name = "uniform_quant"

    def plan(self, ctx: PlanContext) -> Plan:
        policy = ctx.policy
        assert isinstance(policy, UniformQuant)
        bits = Precision(policy.bits)
        cut = max(ctx.seq_len - policy.residual, 0)
        precision = torch.full((ctx.seq_len,), int(Precision.FULL), dtype=torch.int8)
        precision[:cut] = int(bits)
        return Plan(
            precision=precision,
            decode=DecodePrecision(bits, policy.residual),
            note=f"{cut} positions to int{policy.bits}, last {ctx.seq_len - cut} full",
        )
