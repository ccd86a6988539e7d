"""The default policy on a fresh install: per-class rules (see `policies.rules`), plus a little
exploration so that the telemetry covers the arms the rules do not pick."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping

from specgate.engine.step_cost import StepCost
from specgate.engine.vocab import SpecParams
from specgate.policies.arms import OFF, Arm
from specgate.policies.decision import Decision, DecisionContext
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.guards import best_k, prior_for, safe_arms
from specgate.policies.rules import RuleConfig


class RulePolicy:
    kind = "rules"

    def __init__(
        self,
        rules: RuleConfig,
        priors: Mapping[str, float] | None = None,
        budget: ExplorationBudget | None = None,
        seed: int | None = None,
        cost: StepCost | None = None,
        crossovers: dict[str, float] | None = None,
    ) -> None:
        self.rules = rules
        self.priors: Mapping[str, float] = priors or {}
        self.cost = cost  # measured step cost: where speculation stops paying (None: the constant)
        # Per external speculative arm, the batch from which it no longer pays (measured).
        self.crossovers = crossovers or {}
        self.budget = budget or ExplorationBudget(rules.exploration_cap)
        self.rng = random.Random(seed)

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision:
        arms, why = safe_arms(ctx, self.rules, self.cost, self.priors, self.crossovers)
        target = self.target(ctx, arms, why)
        explored = False
        # Exploration happens with probability `rate` when the budget allows it (a pure check), to
        # an arm drawn uniformly from the others: the propensity of either outcome is known exactly.
        rate = self.rules.exploration_rate if explore and len(arms) > 1 and self.budget.allows() else 0.0
        propensity = 1.0 - rate
        if explore and len(arms) > 1 and self.rng.random() < self.rules.exploration_rate and rate > 0:
            target = self.rng.choice([a for a in arms if a != target])
            explored = True
            propensity = rate / (len(arms) - 1)
            why.append(f"exploring {target.key}")
        if explore:
            self.budget.note(explored)
        decision = self.finish(ctx, target, "; ".join(why), explored)
        decision.propensity = propensity
        return decision

    def target(self, ctx: DecisionContext, arms: list[Arm], why: list[str]) -> Arm:
        backend = arms[0].backend
        rule = self.rules.rule_for(ctx.label, ctx.confidence)
        on_backend = [a for a in arms if a.backend == backend]
        name = ctx.label if ctx.confidence >= self.rules.min_confidence else "uncertain"
        method = rule.method
        if ctx.label == "open_chat" and ctx.temperature >= self.rules.high_temperature and method != OFF:
            method = self._high_temperature(ctx, Arm(backend, method), arms, why)
        if arms[0].external:
            # External pools: the one of the class's kind (speculative or not) first in the
            # configured order, else the first; the server drafts as it does.
            pools = [a for a in arms if a.external]
            kind = next((a for a in pools if a.speculative == (method != OFF)), arms[0])
            what = "speculative" if kind.speculative else "plain"
            why.insert(0, f"{name} ({ctx.confidence:.2f}): rule {method}: {what} pool {kind.backend}")
            return kind
        why.insert(0, f"{name} ({ctx.confidence:.2f}): rule {rule.method}")
        wanted = Arm(backend, method)
        if wanted in on_backend:
            return wanted
        fallback = next((a for a in on_backend if a.method == OFF), on_backend[0])
        if method != OFF:
            why.append(f"{wanted.key} not allowed here: {fallback.method}")
        return fallback

    def _high_temperature(self, ctx: DecisionContext, wanted: Arm, arms: list[Arm], why: list[str]) -> str:
        """The method for open chat at or above `high_temperature`. Where the acceptance of the
        request's class, method and temperature band is measured, and the measured step cost can
        weigh it, the measurement decides and the threshold does not apply; otherwise the
        threshold turns speculation off, as on a fresh install. An external pool's step cost is
        never measured: the threshold holds for external pools."""
        t, limit = ctx.temperature, self.rules.high_temperature
        prior = prior_for(ctx, self.priors, wanted)
        external = arms[0].external
        if prior.measured and self.cost is not None and not external:
            k = best_k(ctx, self.rules, self.cost, self.priors, wanted)
            verdict = f"pays K {k}" if k else "pays no K"
            # An arm for which no K pays is gone already where plain decoding remains, and
            # `safe_arms` said why; one still here has nothing plain beside it.
            if k or wanted in arms:
                why.append(
                    f"temperature {t:g} (band {prior.band.label}): measured acceptance {prior.value:.2f} "
                    f"{verdict} at batch {ctx.load.batch + 1}: {'on' if k else 'off'}"
                )
            return wanted.method if k else OFF
        if external:
            unmeasured = "an external pool's step cost is not measured"
        elif prior.measured:
            unmeasured = f"measured acceptance {prior.value:.2f} but no step cost to weigh it"
        else:
            unmeasured = "nothing measured at this temperature"
        why.append(f"temperature {t:g} >= {limit:g}, {unmeasured}: off")
        return OFF

    def finish(self, ctx: DecisionContext, arm: Arm, reason: str, explored: bool) -> Decision:
        rule = self.rules.rule_for(ctx.label, ctx.confidence)
        prior = prior_for(ctx, self.priors, arm)
        if arm.external:  # an external server speculates as it does
            return Decision(arm=arm, reason=reason, explored=explored)
        if not arm.speculative:
            spec = SpecParams(OFF, rule.controller, k_min=0, k_max=0)
            return Decision(arm=arm, reason=reason, spec=spec, explored=explored)
        k_min, k_max = rule.k_range
        if self.cost is not None:
            # K no longer than what pays at this batch, by the measured step cost.
            k_max = max(1, min(k_max, best_k(ctx, self.rules, self.cost, self.priors, arm) or k_max))
            k_min = min(k_min, k_max)
        spec = SpecParams(arm.method, rule.controller, k_min=k_min, k_max=k_max)
        if prior.source != "default":  # measured for the request's band, else its class
            spec = dataclasses.replace(spec, acceptance_prior=prior.value)
        return Decision(arm=arm, reason=reason, spec=spec, explored=explored)
