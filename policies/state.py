"""A policy version's content: its rules, its goodput model (if learned) and its acceptance priors.

Stored as one JSON document per `policy_versions` row; `build` turns it back into a policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specgate.engine.step_cost import StepCost
from specgate.policies.decision import Policy
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel
from specgate.policies.learned_policy import LearnedPolicy
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig


@dataclass(slots=True)
class PolicyState:
    rules: RuleConfig = field(default_factory=RuleConfig)
    model: GoodputModel | None = None
    priors: dict[str, float] = field(default_factory=dict)
    # The engine's measured step cost by batch tokens: where speculation stops paying.
    step_cost: StepCost | None = None
    # Per external speculative arm (and per class and arm): the batch from which it stops paying
    # (policies/crossover.py).
    crossovers: dict[str, float] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "learned" if self.model is not None and self.model.arms else "rules"

    def build(self, budget: ExplorationBudget | None = None, seed: int | None = None) -> Policy:
        budget = budget or ExplorationBudget(self.rules.exploration_cap)
        budget.cap = self.rules.exploration_cap
        if self.model is not None and self.model.arms:
            return LearnedPolicy(
                self.rules, self.model, self.priors, budget, seed, self.step_cost, self.crossovers
            )
        return RulePolicy(self.rules, self.priors, budget, seed, self.step_cost, self.crossovers)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rules": self.rules.as_dict(),
            "model": None if self.model is None else self.model.as_dict(),
            "priors": dict(self.priors),
            "step_cost": None if self.step_cost is None else self.step_cost.as_dict(),
            "crossovers": dict(self.crossovers),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PolicyState:
        model, cost = d.get("model"), d.get("step_cost")
        return cls(
            RuleConfig.from_dict(d.get("rules") or {}),
            None if model is None else GoodputModel.from_dict(model),
            dict(d.get("priors") or {}),
            None if cost is None else StepCost.from_dict(cost),
            {str(k): float(v) for k, v in (d.get("crossovers") or {}).items()},
        )
