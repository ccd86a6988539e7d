"""Hard limits every policy obeys: healthy backends only, safe methods for structured output, no
speculation under a large batch."""

from __future__ import annotations

from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.rules import RuleConfig


def large_batch(ctx: DecisionContext, rules: RuleConfig) -> bool:
    return 0 < rules.max_batch_for_spec <= ctx.load.batch


def safe_arms(ctx: DecisionContext, rules: RuleConfig) -> tuple[list[Arm], list[str]]:
    """The arms this request may take, in preference order, and why others were dropped."""
    why: list[str] = []
    healthy = [
        a
        for a in ctx.arms
        if ctx.load.backends.get(a.backend) is None or ctx.load.backends[a.backend].healthy
    ]
    if not healthy:
        healthy = list(ctx.arms)  # all unhealthy: let failover find out rather than refuse here
        why.append("no backend reports healthy")
    arms = healthy
    if not rules.across_backends:
        arms = [a for a in arms if a.backend == healthy[0].backend]
    if ctx.structured:
        arms = [a for a in arms if not a.speculative or a.method in rules.structured_methods]
        if len(arms) < len(healthy):
            why.append("structured output: only " + ", ".join(rules.structured_methods) + " may speculate")
    if large_batch(ctx, rules):
        kept = [a for a in arms if not a.speculative]
        if kept:
            why.append(f"batch {ctx.load.batch} >= {rules.max_batch_for_spec}: speculation off")
            arms = kept
    return arms, why
