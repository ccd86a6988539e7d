"""Which external backends take a pass-through call, in which order."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.backends.upstream.backend import OpenAIBackend
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.routing.relay import relay_backends
from specgate.gateway.settings import BackendSettings, ModelRoute, Settings


def upstream(name: str, models: dict[str, str], **kw: Any) -> OpenAIBackend:
    settings = BackendSettings(name=name, base_url=f"http://{name}:8000/v1", models=models, **kw)
    return OpenAIBackend(settings, client=None)  # type: ignore[arg-type]  # never called here


def test_the_models_backends_in_route_order_replicas_least_busy_first() -> None:
    solo = upstream("solo", {"emb": "e"})
    r1 = upstream("r1", {"emb": "e"}, replica_group="pool")
    r2 = upstream("r2", {"emb": "e"}, replica_group="pool")
    other = upstream("other", {"chat": "c"})
    registry = BackendRegistry([solo, r1, r2, other])
    settings = Settings(embedded={"enabled": False}, backends=[b.settings for b in (solo, r1, r2, other)])
    assert relay_backends(settings, registry, "emb", "embeddings") == [solo, r1, r2]
    r1._in_flight.enter()
    assert relay_backends(settings, registry, "emb", "embeddings") == [solo, r2, r1]
    # A configured route decides the order, as for chat.
    routed = settings.model_copy(update={"routes": {"emb": ModelRoute(backends=["r2", "solo"])}})
    assert relay_backends(routed, registry, "emb", "embeddings") == [r2, solo]


def test_a_model_nobody_serves_is_a_404() -> None:
    registry = BackendRegistry([upstream("a", {"emb": "e"})])
    with pytest.raises(GatewayError) as err:
        relay_backends(Settings(embedded={"enabled": False}), registry, "nope", "embeddings")
    assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")
