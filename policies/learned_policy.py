"""The learned policy: the arm with the best predicted goodput, chosen by Thompson sampling over the
per-arm posteriors, within the guards and the exploration cap. Falls back to the rules where no
arm is modelled."""

from __future__ import annotations

import random

from specgate.policies.decision import Decision, DecisionContext
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel, vector
from specgate.policies.guards import safe_arms
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig


class LearnedPolicy:
    kind = "learned"

    def __init__(
        self,
        rules: RuleConfig,
        model: GoodputModel,
        priors: dict[str, float] | None = None,
        budget: ExplorationBudget | None = None,
        seed: int | None = None,
    ) -> None:
        self.rules = rules
        self.model = model
        self.budget = budget or ExplorationBudget(rules.exploration_cap)
        self.fallback = RulePolicy(rules, priors, self.budget, seed)
        self.rng = random.Random(seed)

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision:
        arms, why = safe_arms(ctx, self.rules)
        modelled = [a for a in arms if a.key in self.model.arms]
        if not modelled:
            decision = self.fallback.decide(ctx, explore)
            decision.reason = "no modelled arm: rules; " + decision.reason
            return decision
        x = vector(ctx.model_input())
        preds = {a: self.model.arms[a.key].predict(x) for a in modelled}
        greedy = max(modelled, key=lambda a: preds[a].log_mean)
        pick, explored = greedy, False
        if explore:
            unmodelled = [a for a in arms if a.key not in self.model.arms]
            if unmodelled and self.rng.random() < self.rules.exploration_rate and self.budget.allows():
                pick = self.rng.choice(unmodelled)
                why.append(f"exploring {pick.key} (no model yet)")
            elif self.rules.thompson_scale > 0 and len(modelled) > 1:
                scale = self.rules.thompson_scale
                sampled = max(
                    modelled,
                    key=lambda a: preds[a].log_mean + scale * preds[a].log_std * self.rng.gauss(0.0, 1.0),
                )
                if sampled != greedy and self.budget.allows():
                    pick = sampled
                    why.append(f"Thompson sample picked {pick.key} over {greedy.key}")
            explored = pick != greedy
            self.budget.note(explored)
        best = preds[greedy]
        why.insert(0, f"{ctx.label}: best predicted {greedy.key} at {best.tokens_per_s:.1f} tok/s")
        decision = self.fallback.finish(ctx, pick, "; ".join(why), explored)
        decision.predictions = {a.key: p.as_dict() for a, p in preds.items()}
        return decision
