"""Hard limits every policy obeys: healthy backends only, safe methods for structured output, no
speculation where the batch makes verification cost more than it saves: past the crossover that
the measured step cost says (step_cost.py) for the arm's class and method, or, before anything is
measured, past the rules' `max_batch_for_spec`."""

from __future__ import annotations

from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.priors import DEFAULT_PRIOR
from specgate.policies.rules import RuleConfig
from specgate.policies.step_cost import StepCost


def large_batch(ctx: DecisionContext, rules: RuleConfig) -> bool:
    return 0 < rules.max_batch_for_spec <= ctx.load.batch


def k_bound(ctx: DecisionContext, rules: RuleConfig) -> int:
    """The longest draft the rules allow this request."""
    return rules.rule_for(ctx.label, ctx.confidence).k_range[1]


def best_k(
    ctx: DecisionContext, rules: RuleConfig, cost: StepCost, priors: dict[str, float], arm: Arm
) -> int:
    """The draft length that pays most for this arm once this request joins the batch (0: none pays)."""
    p = priors.get(f"{ctx.label}:{arm.method}", DEFAULT_PRIOR)
    return cost.best_k(ctx.load.batch + 1, p, k_bound(ctx, rules))


def safe_arms(
    ctx: DecisionContext,
    rules: RuleConfig,
    cost: StepCost | None = None,
    priors: dict[str, float] | None = None,
    crossovers: dict[str, float] | None = None,
) -> tuple[list[Arm], list[str]]:
    """The arms this request may take, in preference order, and why others were dropped.

    `crossovers`: per class and external speculative arm (`<class>:<arm>`), the batch (its backend's
    requests running and waiting) from which its measured TPOT is no better than the plain pools'
    (retrain measures it); without one, nothing (the learned policy weighs its load meanwhile)."""
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
        # The embedded engine's methods only: an external pool enforces its own output constraints,
        # and dropping its arm would drop the whole server, not a way of drafting on it.
        arms = [a for a in arms if a.external or not a.speculative or a.method in rules.structured_methods]
        if len(arms) < len(healthy):
            why.append("structured output: only " + ", ".join(rules.structured_methods) + " may speculate")
    arms = _external_crossover(ctx, arms, crossovers or {}, why)
    embedded = [a for a in arms if not a.external]
    if cost is not None:
        paying = [a for a in embedded if not a.speculative or best_k(ctx, rules, cost, priors or {}, a) > 0]
        dropped = [a.key for a in embedded if a not in paying]
        if dropped and paying:
            if any(a.speculative for a in paying):
                why.append(f"batch {ctx.load.batch}: {', '.join(dropped)} past the measured crossover")
            else:
                why.append(f"batch {ctx.load.batch} past the measured crossover: speculation off")
            arms = [a for a in arms if a.external or a in paying]
    elif large_batch(ctx, rules) and any(a.speculative for a in embedded):
        kept = [a for a in embedded if not a.speculative]
        if kept:
            why.append(f"batch {ctx.load.batch} >= {rules.max_batch_for_spec}: speculation off")
            arms = [a for a in arms if a.external or a in kept]
    return arms, why


def _external_crossover(
    ctx: DecisionContext, arms: list[Arm], crossovers: dict[str, float], why: list[str]
) -> list[Arm]:
    """Without the speculative external pools whose own batch is past their class's measured
    crossover, as long as a pool that does not speculate remains (a speculative pool past its
    crossover is still a server)."""
    if not any(a.external and not a.speculative for a in arms):
        return arms
    past: dict[Arm, str] = {}
    for a in arms:
        if not (a.external and a.speculative):
            continue
        batch = ctx.load.batch_of(a.backend)
        # Per class only: a line over all classes mixes copyable prompts with prose, and its
        # crossover (often 0) would switch the pool off for the classes where it pays most. No
        # constant stands in before one is measured: an external server's batch counts other
        # clients too, and a busy pool kept out by a guess would never be measured at all.
        limit = crossovers.get(f"{ctx.label}:{a.key}")
        if limit is not None and batch >= limit:
            past[a] = f"{a.key} (batch {batch} >= measured {limit:g})"
    if not past:
        return arms
    why.append("speculative pool past its crossover: " + ", ".join(past.values()))
    return [a for a in arms if a not in past]
