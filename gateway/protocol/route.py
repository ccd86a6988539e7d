"""A route decision: which backends may serve a request, in order, how the engine speculates, and
why; after dispatch, who served it. Typed from the router to the record; it becomes JSON only at the
edges (`metrics.route` in the response, the row's columns).

Immutable, nested collections included: the router builds it, dispatch derives the served route
from it (`served_by`), and the request's record keeps that one as it was. What prefix affinity
learns once the answer is in is the affinity's own state (`routing/router.py` `Plan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgate.engine.vocab import SpecParams
from specgate.policies.arms import OFF, UPSTREAM, Arm
from specgate.policies.frozen import freeze


@dataclass(frozen=True, slots=True)
class RouteDecision:
    model: str
    backends: Sequence[str]  # candidates, tried in this order
    spec: SpecParams | None  # for the embedded engine; external backends decide their own
    policy: str = "static"
    policy_version: str | None = None
    reason: str = ""
    features: Mapping[str, Any] = field(default_factory=dict)
    workload_class: str | None = None
    class_confidence: float | None = None
    explored: bool = False
    predictions: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # per arm, learned policies
    # The chance the policy had of taking the arm it took (None: no policy chose): logged for
    # off-policy evaluation (policies/training/off_policy.py).
    propensity: float | None = None
    # Replica affinity (routing/affinity.py): group, source, home, chosen; `hit` once served.
    affinity: Mapping[str, Any] | None = None
    # Who served, once known.
    backend: str | None = None
    external: bool = False  # an external backend: it decided its own speculation
    arm: str | None = None  # "<backend>:<method>": what actually served (the policy learns from it)
    chosen_arm: str | None = None  # the arm the policy chose (None: no policy chose)
    # External candidates -> the arm of the pool each serves in (a replica group's arm for its
    # members): which replica affinity or failover picks inside a pool leaves the arm as chosen.
    pools: Mapping[str, str] = field(default_factory=dict)
    # The request's latency targets ({"ttft_ms", "tpot_ms"}; None: none) and the chosen arm's
    # predicted headroom against them (target / prediction, >= 1 meets them; None: not predicted).
    slo: Mapping[str, float] | None = None
    slo_headroom: float | None = None
    slo_miss: bool = False  # no arm was predicted to meet them
    # Per external arm the policy weighed, its backend's batch (running + waiting) at the decision.
    pool_batches: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("backends", "features", "predictions", "affinity", "pools", "slo", "pool_batches"):
            object.__setattr__(self, name, freeze(getattr(self, name)))

    def served_by(self, backend: str, external: bool) -> RouteDecision:
        """This route as served by `backend`: what the response's `metrics.route` and the record say."""
        if external:
            arm = self.pools.get(backend) or Arm(backend, UPSTREAM).key
        else:
            arm = Arm(backend, self.spec.method if self.spec is not None else OFF).key
        # Failover to another pool: the outcome is not the chosen arm's, so the chance of choosing
        # it would weigh the wrong arm in off-policy evaluation.
        failed_over = self.chosen_arm is not None and arm != self.chosen_arm
        affinity = self.affinity
        if affinity is not None:
            # A hit: the conversation's home replica served it (no spill for load, no failover).
            home = affinity.get("home")
            affinity = {**affinity, "hit": None if home is None else backend == home}
        return dataclasses.replace(
            self,
            backend=backend,
            external=external,
            arm=arm,
            propensity=None if failed_over else self.propensity,
            affinity=affinity,
        )

    def as_dict(self) -> dict[str, Any]:
        spec: dict[str, Any] | None = None
        if not self.external:
            spec = dataclasses.asdict(self.spec) if self.spec is not None else {"method": "off"}
        out: dict[str, Any] = {
            "backend": self.backend,
            "candidates": list(self.backends),
            "spec": spec,
            "policy": self.policy,
            "policy_version": self.policy_version,
            "reason": self.reason,
        }
        if self.workload_class is not None:
            out["workload_class"] = self.workload_class
            out["explored"] = self.explored
        if self.predictions:
            out["predictions"] = self.predictions
        if self.propensity is not None:
            out["propensity"] = self.propensity
        if self.arm is not None:
            out["arm"] = self.arm
        if self.chosen_arm is not None and self.chosen_arm != self.arm:
            out["chosen_arm"] = self.chosen_arm
        if self.affinity is not None:
            out["affinity"] = dict(self.affinity)
        if self.pool_batches:
            out["pool_batches"] = dict(self.pool_batches)
        if self.slo is not None:
            out["slo"] = dict(self.slo)
            out["slo_headroom"] = self.slo_headroom
            out["slo_miss"] = self.slo_miss
        return out
