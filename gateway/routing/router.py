"""The router: which backends (in order) serve a request, and how the embedded engine speculates.

One router, with or without a routing policy. With one (`policy.enabled`, the default), it
classifies the request, reads the load and lets the active policy pick an arm; without, the
configured routes and speculation settings decide (static routing is the policy switched off).
Operators keep the last word where they spoke, and `_speculation` is the one place that says how:
a route's pinned `spec` overrides the policy, a request's own `spec` extension applies on top of
whatever won (the request is still classified and recorded, so the policy learns from it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.affinity import Affinity, AffinityChoice
from specgate.gateway.routing.request_info import request_info
from specgate.gateway.settings import Settings
from specgate.policies.arms import OFF, Arm
from specgate.policies.classifier import Classification, WorkloadClassifier
from specgate.policies.decision import Decision, DecisionContext, Slo
from specgate.policies.features import request_features
from specgate.policies.load import Load

Request = ChatCompletionRequest | CompletionRequest
STATIC = "static"  # the policy label of a route decided without a routing policy
CONFIGURED = "configured route"  # why the candidates are what they are: the operator listed them


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """What routing by policy needs: the workload classifier and the active policy."""

    classifier: WorkloadClassifier
    manager: PolicyManager


@dataclass(slots=True)
class Plan:
    """A route and how it was reached (the policy's part only when a policy decided)."""

    route: RouteDecision
    load: Load
    decision: Decision | None = None
    classification: Classification | None = None
    arms: list[Arm] = dataclasses.field(default_factory=list)
    # The prompt's block hashes where prefix affinity read them: affinity's own state, handed back
    # to it once the request is over (`Affinity.observe` / `undo`); never part of the record.
    prefix_blocks: tuple[int, ...] | None = None

    def explain(self) -> dict[str, Any]:
        c, decision = self.classification, self.decision
        if c is None or decision is None:
            return {"policy": STATIC, "route": self.route.as_dict()}
        return {
            "workload_class": c.label,
            "class_confidence": round(c.confidence, 4),
            "class_probs": c.probs,
            "class_rule": c.rule,
            "features": self.route.features,
            "load": self.load.features(),
            "arms": [a.key for a in self.arms],
            "predictions": decision.predictions,
            "decision": decision.as_dict(),
            "route": self.route.as_dict(),
        }


class Router:
    def __init__(self, settings: Settings, registry: BackendRegistry, policy: RoutingPolicy | None) -> None:
        self.settings = settings
        self.registry = registry
        self.policy = policy
        self.allowed = allowed_methods(settings)
        self.affinity = Affinity(settings, registry)

    def route(
        self, request: Request, load: Load, slo: Slo | None = None, scope: str | None = ""
    ) -> RouteDecision:
        """`load`: the load at the request's arrival, the same one its record keeps; `slo`: its
        latency targets; `scope`: whose earlier prompts prefix affinity may match it against (its
        prefix-cache scope and salt; None: nobody's)."""
        return self.plan(request, load, slo=slo, scope=scope).route

    def admit(self, plan: Plan) -> None:
        """429 where no arm is predicted to meet the request's latency targets and the operator
        refuses those (checked after the route is kept, so the refused request's row has it)."""
        if plan.route.slo_miss and self.settings.slo.reject:
            self.affinity.undo(plan.route, plan.prefix_blocks)
            raise GatewayError(
                429,
                "no backend is predicted to serve this request within its latency targets now",
                code="slo_unattainable",
                retry_after=self.settings.retry_after_seconds,
            )

    def plan(
        self,
        request: Request,
        load: Load,
        explore: bool = True,
        slo: Slo | None = None,
        scope: str | None = "",
    ) -> Plan:
        names, why = candidate_backends(self.settings, self.registry, request.model)
        if self.policy is None:
            names, choice = self.affinity.arrange(names, request, explore, scope, load.backends)
            slo_dict = slo.as_dict() if slo is not None else None
            spec, policy, reason = self._speculation(request, None, STATIC, why, why)
            route = RouteDecision(
                model=request.model,
                backends=names,
                spec=spec,
                policy=policy,
                reason=reason,
                affinity=choice.as_dict() if choice is not None else None,
                slo=slo_dict,
            )
            return Plan(route, load, prefix_blocks=_blocks(choice))
        return self._policy_plan(self.policy, request, load, names, why, explore, slo, scope)

    def arms(self, names: list[str]) -> list[Arm]:
        """The arms of the candidate backends, in their order: the embedded engine's per method;
        one per external backend or replica group (affinity picks the replica inside it), of the
        kind its speculation makes it."""
        out: list[Arm] = []
        embedded = self.registry.embedded
        pools: set[str] = set()
        for name in names:
            if embedded is not None and name == embedded.name:
                out.append(Arm(name, OFF))
                out.extend(Arm(name, m) for m in self.settings.policy.methods if m in embedded.methods)
                continue
            pool = self.registry.group_of.get(name, name)
            if pool not in pools:
                pools.add(pool)
                out.append(Arm.upstream(pool, self.registry.pool_speculation(pool)))
        return out

    def pool_members(self, pool: str, names: list[str]) -> list[str]:
        """The candidates an arm's backend name stands for: a replica group's members, or itself."""
        return [n for n in names if self.registry.group_of.get(n, n) == pool]

    def _policy_plan(
        self,
        policy: RoutingPolicy,
        request: Request,
        load: Load,
        names: list[str],
        why: str,
        explore: bool,
        slo: Slo | None,
        scope: str | None,
    ) -> Plan:
        asking = not explore  # an operator's explain: nothing may change, the prefix index included
        info = request_info(request)
        cls = policy.classifier.classify(info)
        features = request_features(info, cls.probs)
        arms = self.arms(names)
        if why == CONFIGURED:
            # An operator's `routes.<model>.backends` is an ordered failover plan (LiteLLM's
            # fallbacks), not a pool to spread over: the policy chooses among the arms of its
            # first healthy backend (or replica group) only, and the rest wait for failures.
            up = [a for a in arms if (b := load.backends.get(a.backend)) is None or b.healthy]
            first = (up or arms)[0].backend
            arms = [a for a in arms if a.backend == first]
        manager = policy.manager
        # A seeded request is never explored: the same seed must give the same answer, and a
        # speculative arm draws its random numbers differently from plain sampling.
        explore = explore and request.seed is None
        decision = manager.decide(
            DecisionContext(cls.label, cls.confidence, features, load, arms, slo), explore
        )
        arm = decision.arm
        members = self.pool_members(arm.backend, names) or [arm.backend]
        backends = [*members, *(n for n in names if n not in members)]
        # The policy picks a pool; among its replicas, affinity picks the one for this request.
        backends, choice = self.affinity.arrange(backends, request, not asking, scope, load.backends)
        chosen = None if arm.external else decision.spec
        spec, label, reason = self._speculation(request, chosen, manager.state.kind, decision.reason, why)
        route = RouteDecision(
            model=request.model,
            backends=backends,
            spec=spec,
            policy=label,
            policy_version=None if manager.version is None else str(manager.version),
            reason=reason,
            # The request's features and every candidate's load (the arm models read their own).
            features={**features, **load.features({a.backend for a in arms})},
            workload_class=cls.label,
            class_confidence=round(cls.confidence, 4),
            explored=decision.explored,
            predictions=decision.predictions,
            propensity=decision.propensity if label not in ("request", "route") else None,
            affinity=choice.as_dict() if choice is not None else None,
            chosen_arm=arm.key,
            slo=slo.as_dict() if slo is not None else None,
            slo_headroom=None if decision.slo_headroom is None else round(decision.slo_headroom, 4),
            slo_miss=decision.slo_miss,
            pools={n: a.key for a in arms if a.external for n in self.pool_members(a.backend, names)},
            pool_batches={a.key: load.batch_of(a.backend) for a in arms if a.external},
        )
        return Plan(route, load, decision, cls, arms, _blocks(choice))

    def _speculation(
        self, request: Request, chosen: SpecParams | None, policy: str, reason: str, why: str
    ) -> tuple[SpecParams | None, str, str]:
        """Which speculation setting wins, and who set it (the route's `policy` label) and why.

        From the bottom: without a policy, the route's configured `spec` or else the engine's
        default (the configuration decides); with one, the policy's choice (None: it sent the
        request to an external backend, which speculates as it does), unless a route pins `spec`.
        On top of what won, the request's own `spec` (on the engine's default where what won is
        off: zero K bounds would silently cancel a method the request asks for)."""
        configured = self.settings.routes.get(request.model)
        pinned = configured.spec if configured is not None else None
        spec = chosen
        if self.policy is None:
            spec = pinned if pinned is not None else self.settings.embedded.spec
        elif pinned is not None:
            spec, policy, reason = pinned, "route", f"{why}: speculation pinned by the route"
        if request.spec is not None:
            base = spec if spec is not None and spec.method != OFF else self.settings.embedded.spec
            spec = requested_spec(base, request, self.allowed)
            policy, reason = "request", reason + "; speculation set by the request"
        return spec, policy, reason


def _blocks(choice: AffinityChoice | None) -> tuple[int, ...] | None:
    return tuple(choice.blocks) if choice is not None and choice.blocks else None


def candidate_backends(settings: Settings, registry: BackendRegistry, model: str) -> tuple[list[str], str]:
    """The backends that may serve `model`, in preference order, and why; 404 if there are none."""
    configured = settings.routes.get(model)
    if configured is not None and configured.backends:
        names, reason = list(configured.backends), CONFIGURED
    else:
        names, reason = [b.name for b in registry.serving(model)], "backends serving the model"
    if not names:
        raise GatewayError(
            404,
            f"The model `{model}` does not exist or is not served here.",
            code="model_not_found",
            param="model",
        )
    return names, reason


def allowed_methods(settings: Settings) -> frozenset[str]:
    """Speculation methods a request may ask for: those the operator's policy may choose, and those
    the operator configured for the engine or a route. Anything else is refused, never run."""
    methods = {"off", *settings.policy.methods, settings.embedded.spec.method}
    methods.update(r.spec.method for r in settings.routes.values() if r.spec is not None)
    return frozenset(methods)


def requested_spec(base: SpecParams, request: Request, allowed: frozenset[str]) -> SpecParams:
    """`base` with the request's own `spec` extension applied; 400 if the result is invalid or asks
    for a method the operator does not allow."""
    assert request.spec is not None
    method = request.spec.method
    if method is not None and method not in allowed:
        raise GatewayError(
            400,
            f"speculation method {method!r} is not allowed here; allowed: {', '.join(sorted(allowed))}",
            param="spec.method",
            code="invalid_spec_method",
        )
    overrides = request.spec.model_dump(exclude_none=True)
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as exc:
        raise GatewayError(400, f"invalid spec: {exc}", param="spec", code="invalid_value") from exc
