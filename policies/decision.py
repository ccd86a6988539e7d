"""What a policy sees (`DecisionContext`) and what it answers (`Decision`), and the protocol between."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from specgate.policies.arms import Arm
from specgate.policies.load import Load


@dataclass(slots=True)
class DecisionContext:
    label: str  # workload class
    confidence: float
    features: dict[str, float]  # request features (policies.features.request_features)
    load: Load
    arms: list[Arm]  # what may serve this request, preferred backend first

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("a decision needs at least one arm")

    @property
    def structured(self) -> bool:
        return self.label == "tool_call" or self.features.get("tools_or_json", 0.0) > 0

    @property
    def temperature(self) -> float:
        return float(self.features.get("temperature", 1.0))

    def model_input(self) -> dict[str, float]:
        return {**self.features, **self.load.features()}


@dataclass(slots=True)
class Decision:
    arm: Arm
    reason: str
    k_min: int = 0
    k_max: int = 0
    controller: str = "goodput"
    acceptance_prior: float | None = None
    explored: bool = False
    # Per arm key: predicted output tokens/s (mean, spread) and TPOT, where a model predicted.
    predictions: dict[str, dict[str, float]] = field(default_factory=dict)
    # The probability that this policy, in this state, takes `arm` for this request (exploration
    # and Thompson sampling included): what off-policy evaluation weighs the logged outcome by.
    propensity: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.propensity <= 1.0:
            raise ValueError("propensity must be in (0, 1]")

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm.key,
            "backend": self.arm.backend,
            "method": self.arm.method,
            "k_min": self.k_min,
            "k_max": self.k_max,
            "controller": self.controller,
            "acceptance_prior": self.acceptance_prior,
            "explored": self.explored,
            "reason": self.reason,
            "predictions": self.predictions,
            "propensity": self.propensity,
        }


class Policy(Protocol):
    kind: str  # "rules" | "learned"

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision: ...
