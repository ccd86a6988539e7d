"""The adaptive router: classify the request, read the load, let the active policy pick an arm.

Operators keep the last word where they spoke: a configured route's backends bound the choice, and
speculation pinned by a route's `spec` or by the request's own `spec` extension is honoured (the
request is still classified and recorded, so the policy learns from it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.affinity import Affinity
from specgate.gateway.routing.request_info import request_info
from specgate.gateway.routing.static import allowed_methods, candidate_backends, requested_spec
from specgate.gateway.settings import Settings
from specgate.policies.arms import OFF, UPSTREAM, Arm
from specgate.policies.classifier import Classification, WorkloadClassifier
from specgate.policies.decision import Decision, DecisionContext
from specgate.policies.features import request_features
from specgate.policies.load import Load


@dataclass(slots=True)
class Plan:
    route: RouteDecision
    decision: Decision
    classification: Classification
    load: Load
    arms: list[Arm]

    def explain(self) -> dict[str, Any]:
        c = self.classification
        return {
            "workload_class": c.label,
            "class_confidence": round(c.confidence, 4),
            "class_probs": c.probs,
            "class_rule": c.rule,
            "features": self.route.features,
            "load": self.load.features(),
            "arms": [a.key for a in self.arms],
            "predictions": self.decision.predictions,
            "decision": self.decision.as_dict(),
            "route": self.route.as_dict(),
        }


class PolicyRouter:
    def __init__(
        self,
        settings: Settings,
        registry: BackendRegistry,
        classifier: WorkloadClassifier,
        manager: PolicyManager,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.classifier = classifier
        self.manager = manager
        self.allowed = allowed_methods(settings)
        self.affinity = Affinity(settings, registry)

    def route(self, request: ChatCompletionRequest | CompletionRequest, load: Load) -> RouteDecision:
        return self.plan(request, load).route

    def arms(self, names: list[str]) -> list[Arm]:
        out: list[Arm] = []
        embedded = self.registry.embedded
        for name in names:
            if embedded is not None and name == embedded.name:
                out.append(Arm(name, OFF))
                out.extend(Arm(name, m) for m in self.settings.policy.methods if m in embedded.methods)
            else:
                out.append(Arm(name, UPSTREAM))
        return out

    def plan(
        self, request: ChatCompletionRequest | CompletionRequest, load: Load, explore: bool = True
    ) -> Plan:
        names, why = candidate_backends(self.settings, self.registry, request.model)
        info = request_info(request)
        cls = self.classifier.classify(info)
        features = request_features(info, cls.probs)
        arms = self.arms(names)
        manager = self.manager
        # A seeded request is never explored: the same seed must give the same answer, and a
        # speculative arm draws its random numbers differently from plain sampling.
        explore = explore and request.seed is None
        decision = manager.decide(DecisionContext(cls.label, cls.confidence, features, load, arms), explore)
        arm = decision.arm
        backends = [arm.backend, *(n for n in names if n != arm.backend)]
        # The policy picks a backend; among its replicas, the conversation's own goes first.
        backends, choice = self.affinity.arrange(backends, request)
        spec: SpecParams | None = None
        if arm.method != UPSTREAM:
            spec = SpecParams(
                method=arm.method if arm.speculative else OFF,
                controller=decision.controller,
                k_min=decision.k_min,
                k_max=decision.k_max,
            )
            if decision.acceptance_prior is not None:  # measured for the class; else the engine's default
                spec.acceptance_prior = decision.acceptance_prior
        policy, reason = manager.state.kind, decision.reason
        configured = self.settings.routes.get(request.model)
        if configured is not None and configured.spec is not None:
            spec, policy, reason = configured.spec, "route", f"{why}: speculation pinned by the route"
        if request.spec is not None:
            # On top of the policy's choice, or of the configured default where the policy chose off
            # (its zero K bounds would silently cancel a request that asks for a method).
            base = spec if spec is not None and spec.method != OFF else self.settings.embedded.spec
            spec = requested_spec(base, request, self.allowed)
            policy, reason = "request", reason + "; speculation set by the request"
        route = RouteDecision(
            model=request.model,
            backends=backends,
            spec=spec,
            policy=policy,
            policy_version=None if manager.version is None else str(manager.version),
            reason=reason,
            features={**features, **load.features()},
            workload_class=cls.label,
            class_confidence=round(cls.confidence, 4),
            explored=decision.explored,
            predictions=decision.predictions,
            propensity=decision.propensity if policy not in ("request", "route") else None,
            affinity=choice.as_dict() if choice is not None else None,
        )
        return Plan(route, decision, cls, load, arms)
