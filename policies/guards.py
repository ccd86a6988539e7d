"""Hard limits every policy obeys: healthy backends only, safe methods for structured output, no
speculation where verification costs more than it saves: where, by the measured step cost
(engine/step_cost.py), no draft length pays at the batch this request joins and the acceptance
measured for its class, method and temperature band (priors.py), or, before a step cost is
measured, past the rules' `max_batch_for_spec`."""

from __future__ import annotations

from collections.abc import Mapping

from specgate.engine.step_cost import StepCost
from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.priors import Prior, lookup
from specgate.policies.rules import RuleConfig


def large_batch(ctx: DecisionContext, rules: RuleConfig) -> bool:
    return 0 < rules.max_batch_for_spec <= ctx.load.batch


def k_bound(ctx: DecisionContext, rules: RuleConfig) -> int:
    """The longest draft the rules allow this request."""
    return rules.rule_for(ctx.label, ctx.confidence).k_range[1]


def prior_for(ctx: DecisionContext, priors: Mapping[str, float], arm: Arm) -> Prior:
    """The acceptance prior of this request's class, the arm's method and the request's temperature."""
    return lookup(priors, ctx.label, arm.method, ctx.temperature)


def best_k(
    ctx: DecisionContext, rules: RuleConfig, cost: StepCost, priors: Mapping[str, float], arm: Arm
) -> int:
    """The draft length that pays most for this arm once this request joins the batch (0: none pays),
    at the acceptance measured for the request's class, the arm's method and the request's band."""
    p = prior_for(ctx, priors, arm).value
    return cost.best_k(ctx.load.batch + 1, p, k_bound(ctx, rules))


def safe_arms(
    ctx: DecisionContext,
    rules: RuleConfig,
    cost: StepCost | None = None,
    priors: Mapping[str, float] | None = None,
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
        arms = _measured_cost(ctx, rules, cost, priors or {}, arms, why)
    elif large_batch(ctx, rules) and any(a.speculative for a in embedded):
        kept = [a for a in embedded if not a.speculative]
        if kept:
            why.append(f"batch {ctx.load.batch} >= {rules.max_batch_for_spec}: speculation off")
            arms = [a for a in arms if a.external or a in kept]
    return arms, why


def _measured_cost(
    ctx: DecisionContext,
    rules: RuleConfig,
    cost: StepCost,
    priors: Mapping[str, float],
    arms: list[Arm],
    why: list[str],
) -> list[Arm]:
    """Without the engine's speculative arms for which no draft length pays, as long as one that
    pays (or plain decoding) remains. Why is told apart: an arm whose acceptance measured at this
    request's temperature pays at no batch at all is off for the temperature, and the reason says
    so without the load's mark (": speculation off", which the dashboard counts as load); any
    other is past the crossover of the batch."""
    embedded = [a for a in arms if not a.external]
    paying = [a for a in embedded if not a.speculative or best_k(ctx, rules, cost, priors, a) > 0]
    dropped = [a for a in embedded if a not in paying]
    if not dropped or not paying:
        return arms
    spec_left = any(a.speculative for a in paying)
    by_temperature: dict[Arm, Prior] = {}
    for a in dropped:
        prior = prior_for(ctx, priors, a)
        if prior.measured and cost.best_k(1, prior.value, k_bound(ctx, rules)) == 0:
            by_temperature[a] = prior
    by_batch = [a.key for a in dropped if a not in by_temperature]
    if by_temperature:
        first = next(iter(by_temperature.values()))
        if len(by_temperature) == 1:
            measured = f"{first.value:.2f}"
        else:
            measured = ", ".join(f"{a.key} {p.value:.2f}" for a, p in by_temperature.items())
        what = ", ".join(a.key for a in by_temperature) + " dropped" if spec_left or by_batch else "off"
        why.append(
            f"temperature {ctx.temperature:g} (band {first.band.label}): measured acceptance {measured} "
            f"pays no K at batch {ctx.load.batch + 1}: {what}"
        )
    if by_batch:
        if spec_left:
            why.append(f"batch {ctx.load.batch}: {', '.join(by_batch)} past the measured crossover")
        else:
            why.append(f"batch {ctx.load.batch} past the measured crossover: speculation off")
    return [a for a in arms if a.external or a in paying]


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
