"""Which external backends take a pass-through call (embeddings, rerank, tokenize, detokenize).

The model resolves to backends as for chat (`router.candidate_backends`: the configured route, else
every backend that serves the model), minus the embedded engine, which answers none of these
endpoints as a backend. No policy and no prefix affinity: there is no prompt to place and no arm
to learn; replicas of one group are taken least busy first, so one replica does not take them all.
"""

from __future__ import annotations

from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.backends.upstream.backend import OpenAIBackend
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.routing.router import candidate_backends
from specgate.gateway.settings import Settings


def relay_backends(
    settings: Settings, registry: BackendRegistry, model: str, what: str
) -> list[OpenAIBackend]:
    """The external backends that may serve `model`'s `what` endpoint, in the order to try them;
    404 for a model nobody serves, 400 for one only the embedded engine serves."""
    names, _ = candidate_backends(settings, registry, model)
    found = [registry.get(n) for n in names]
    external = [b for b in found if isinstance(b, OpenAIBackend)]
    if not external:
        raise GatewayError(
            400,
            f"The model `{model}` does not serve {what}: it runs on the gateway's embedded engine, "
            "which serves chat and completions (and /tokenize, /detokenize) only.",
            code="model_not_supported",
            param="model",
        )
    # The first position of each backend's group (or its own): groups keep the route's order.
    first: dict[str, int] = {}
    for i, b in enumerate(external):
        first.setdefault(registry.group_of.get(b.name, b.name), i)
    return sorted(external, key=lambda b: (first[registry.group_of.get(b.name, b.name)], b.in_flight))
