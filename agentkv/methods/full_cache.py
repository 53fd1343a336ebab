"""FullCache: keep every token at full precision (the reference every method is compared to)."""

from __future__ import annotations

from agentkv.methods.base import Method, Plan, PlanContext, register_method


@register_method
class FullCacheMethod(Method):
    name = "full"

    def plan(self, ctx: PlanContext) -> Plan:
        return Plan(note="full cache: nothing evicted")
