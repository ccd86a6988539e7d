"""The routing seam: which backends (in order) serve a request, and how the engine speculates.

`StaticRouter` is the configured default: model -> backends and speculation settings from config,
a request's own `spec` extension on top. The learning policy plugs in behind the same protocol.
Every decision is recorded on the request and returned in its `metrics.route`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing.affinity import Affinity
from specgate.gateway.settings import Settings
from specgate.policies.load import Load


class Router(Protocol):
    def route(self, request: ChatCompletionRequest | CompletionRequest, load: Load) -> RouteDecision:
        """`load`: the load at the request's arrival, the same snapshot its record keeps."""
        ...


class StaticRouter:
    def __init__(self, settings: Settings, registry: BackendRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.allowed = allowed_methods(settings)
        self.affinity = Affinity(settings, registry)

    def route(self, request: ChatCompletionRequest | CompletionRequest, load: Load) -> RouteDecision:
        names, reason = candidate_backends(self.settings, self.registry, request.model)
        names, choice = self.affinity.arrange(names, request)
        configured = self.settings.routes.get(request.model)
        spec = (
            configured.spec
            if configured is not None and configured.spec is not None
            else self.settings.embedded.spec
        )
        if request.spec is not None:
            spec = requested_spec(spec, request, self.allowed)
            reason += "; speculation set by the request"
        affinity = choice.as_dict() if choice is not None else None
        return RouteDecision(model=request.model, backends=names, spec=spec, reason=reason, affinity=affinity)


def candidate_backends(settings: Settings, registry: BackendRegistry, model: str) -> tuple[list[str], str]:
    """The backends that may serve `model`, in preference order, and why; 404 if there are none."""
    configured = settings.routes.get(model)
    if configured is not None and configured.backends:
        names, reason = list(configured.backends), "configured route"
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


def requested_spec(
    base: SpecParams, request: ChatCompletionRequest | CompletionRequest, allowed: frozenset[str]
) -> SpecParams:
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
