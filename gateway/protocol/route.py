"""A route decision: which backends may serve a request, in order, how the engine speculates, and
why; after dispatch, who served it. Typed from the router to the record; it becomes JSON only at the
edges (`metrics.route` in the response, the row's columns)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specgate.engine.spec_decode.params import SpecParams
from specgate.policies.arms import OFF, UPSTREAM, Arm


@dataclass(slots=True)
class RouteDecision:
    model: str
    backends: list[str]  # candidates, tried in this order
    spec: SpecParams | None  # for the embedded engine; external backends decide their own
    policy: str = "static"
    policy_version: str | None = None
    reason: str = ""
    features: dict[str, Any] = field(default_factory=dict)
    workload_class: str | None = None
    class_confidence: float | None = None
    explored: bool = False
    predictions: dict[str, dict[str, float]] = field(default_factory=dict)  # per arm, learned policies
    # The chance the policy had of taking the arm it took (None: no policy chose): logged for
    # off-policy evaluation (policies/training/off_policy.py).
    propensity: float | None = None
    # Replica affinity (routing/affinity.py): group, source, home, chosen; `hit` once served.
    affinity: dict[str, Any] | None = None
    # Who served, once known.
    backend: str | None = None
    external: bool = False  # an external backend: it decided its own speculation
    arm: str | None = None  # "<backend>:<method>": what actually served (the policy learns from it)

    def served_by(self, backend: str, external: bool) -> None:
        self.backend, self.external = backend, external
        method = UPSTREAM if external else (self.spec.method if self.spec is not None else OFF)
        self.arm = Arm(backend, method).key
        if self.affinity is not None:
            # A hit: the conversation's home replica served it (no spill for load, no failover).
            home = self.affinity.get("home")
            self.affinity["hit"] = None if home is None else backend == home

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
        if self.affinity is not None:
            out["affinity"] = dict(self.affinity)
        return out
