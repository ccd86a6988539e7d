"""What a policy sees (`DecisionContext`) and what it answers (`Decision`), and the protocol between."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from specgate.engine.vocab import SpecParams
from specgate.policies.arms import Arm
from specgate.policies.load import Load


@dataclass(slots=True, frozen=True)
class Slo:
    """A request's latency targets in milliseconds (None: no target of that kind)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for v in (self.ttft_ms, self.tpot_ms):
            if v is not None and not 0.0 < v <= 1e7:
                raise ValueError("SLO targets must be in (0, 1e7] ms")

    def headroom(self, ttft_ms: float | None, tpot_ms: float | None) -> float | None:
        """The smallest ratio of target to prediction over the targets set (>= 1: met; None: a
        target without its prediction, so unknown)."""
        ratios = []
        for target, predicted in ((self.ttft_ms, ttft_ms), (self.tpot_ms, tpot_ms)):
            if target is None:
                continue
            if predicted is None:
                return None
            ratios.append(target / max(predicted, 1e-9))
        return min(ratios) if ratios else None

    def as_dict(self) -> dict[str, float]:
        out = {}
        if self.ttft_ms is not None:
            out["ttft_ms"] = self.ttft_ms
        if self.tpot_ms is not None:
            out["tpot_ms"] = self.tpot_ms
        return out


@dataclass(slots=True)
class DecisionContext:
    label: str  # workload class
    confidence: float
    features: dict[str, float]  # request features (policies.features.request_features)
    load: Load
    arms: list[Arm]  # what may serve this request, preferred backend first
    slo: Slo | None = None  # the request's latency targets, if it has any

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("a decision needs at least one arm")

    @property
    def structured(self) -> bool:
        return self.label == "tool_call" or self.features.get("tools_or_json", 0.0) > 0

    @property
    def temperature(self) -> float:
        return float(self.features.get("temperature", 1.0))

    def model_input(self, arm: Arm) -> dict[str, float]:
        """What `arm`'s goodput model reads: the request's features and its own backend's load."""
        return {**self.features, **self.load.arm_features(arm.backend)}


@dataclass(slots=True)
class Decision:
    arm: Arm
    reason: str
    # How the embedded engine speculates for this arm ("off" for its plain arm); None for an external
    # arm, whose server speculates as it does.
    spec: SpecParams | None = None
    explored: bool = False
    # Per arm key: predicted output tokens/s (mean, spread) and TPOT, where a model predicted.
    predictions: dict[str, dict[str, float]] = field(default_factory=dict)
    # The probability that this policy, in this state, takes `arm` for this request (exploration
    # and Thompson sampling included): what off-policy evaluation weighs the logged outcome by.
    propensity: float = 1.0
    # With latency targets: the chosen arm's predicted headroom (target / prediction, the worse of
    # TTFT and TPOT; >= 1 meets them) and whether no modelled arm was predicted to meet them.
    slo_headroom: float | None = None
    slo_miss: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.propensity <= 1.0:
            raise ValueError("propensity must be in (0, 1]")

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.arm.key,
            "backend": self.arm.backend,
            "method": self.arm.method,
            # Flat, as the dashboard's explain view reads them (an external arm: K 0).
            "k_min": self.spec.k_min if self.spec is not None else 0,
            "k_max": self.spec.k_max if self.spec is not None else 0,
            "controller": self.spec.controller if self.spec is not None else "goodput",
            "acceptance_prior": self.spec.acceptance_prior if self.spec is not None else None,
            "explored": self.explored,
            "reason": self.reason,
            "predictions": self.predictions,
            "propensity": self.propensity,
            "slo_headroom": self.slo_headroom,
            "slo_miss": self.slo_miss,
        }


class Policy(Protocol):
    kind: str  # "rules" | "learned"

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision: ...
