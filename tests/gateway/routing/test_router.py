"""The router's one rule for which speculation setting wins, with and without a routing policy."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.engine.vocab import SpecParams
from specgate.gateway.backends.registry import BackendRegistry
from specgate.gateway.backends.upstream.client import UpstreamClient
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from specgate.gateway.routing.router import STATIC, Router, RoutingPolicy
from specgate.gateway.settings import Settings

DEFAULT = SpecParams("ngram", "goodput", 0, 6)
PINNED = SpecParams("suffix", "static", 2, 4)
CHOSEN = SpecParams("off", "goodput", 0, 0)  # the policy's choice: plain decoding


def _router(with_policy: bool, pinned: SpecParams | None) -> Router:
    settings = Settings(
        embedded={"enabled": False, "spec": DEFAULT},
        backends=[{"name": "up", "base_url": "http://127.0.0.1:9/v1", "models": ["m", "p"]}],
        routes={"p": {"spec": pinned}} if pinned is not None else {},
        policy={"methods": ["ngram", "suffix"]},
    )
    registry = BackendRegistry.from_settings(settings, UpstreamClient(), None)
    # The precedence rule reads only whether a policy is there, not what it holds.
    policy: Any = RoutingPolicy(classifier=None, manager=None) if with_policy else None  # type: ignore[arg-type]
    return Router(settings, registry, policy)


def _request(model: str, spec: dict[str, Any] | None = None) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if spec is not None:
        body["spec"] = spec
    return ChatCompletionRequest.model_validate(body)


def test_without_a_policy_the_configuration_decides_and_the_request_goes_on_top() -> None:
    router = _router(False, PINNED)
    assert router._speculation(_request("m"), None, STATIC, "why", "why") == (DEFAULT, STATIC, "why")
    assert router._speculation(_request("p"), None, STATIC, "why", "why") == (PINNED, STATIC, "why")
    spec, label, reason = router._speculation(_request("p", {"k_max": 3}), None, STATIC, "why", "why")
    assert spec == SpecParams("suffix", "static", 2, 3) and label == "request"
    assert reason == "why; speculation set by the request"


def test_with_a_policy_a_pinned_route_overrides_it_and_the_request_goes_on_top() -> None:
    router = _router(True, PINNED)
    assert router._speculation(_request("m"), CHOSEN, "learned", "arm", "why") == (CHOSEN, "learned", "arm")
    assert router._speculation(_request("m"), None, "learned", "arm", "why") == (None, "learned", "arm")
    got = router._speculation(_request("p"), CHOSEN, "learned", "arm", "why")
    assert got == (PINNED, "route", "why: speculation pinned by the route")
    # On top of a choice of plain decoding, a request's method starts from the configured default:
    # the choice's zero K bounds would cancel it.
    spec, label, _ = router._speculation(_request("m", {"method": "suffix"}), CHOSEN, "learned", "arm", "w")
    assert spec == SpecParams("suffix", "goodput", 0, 6) and label == "request"


@pytest.mark.parametrize("with_policy", [False, True])
def test_a_method_the_operator_does_not_allow_is_refused(with_policy: bool) -> None:
    router = _router(with_policy, None)
    with pytest.raises(GatewayError) as err:
        router._speculation(_request("m", {"method": "eagle"}), CHOSEN, "learned", "arm", "why")
    assert err.value.status == 400 and err.value.param == "spec.method"


@pytest.mark.parametrize("with_policy", [False, True])
def test_a_request_on_a_route_pinned_off_starts_from_the_configured_default(with_policy: bool) -> None:
    """A route pinned to plain decoding has zero K bounds: a request that asks for a method gets
    it with the engine's configured bounds, in both modes alike."""
    router = _router(with_policy, SpecParams("off", "static", 0, 0))
    spec, label, _ = router._speculation(_request("p", {"method": "suffix"}), CHOSEN, "learned", "arm", "w")
    assert spec == SpecParams("suffix", "goodput", 0, 6) and label == "request"
