"""Failover across external backends, breakers and health probes, through a live gateway.

Two scripted upstreams `a` and `b` (tests/gateway/fake_upstream.py) serve the same public model, `a`
first in configured order; each answers with its own text so the tests can tell who served.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from specgate.gateway.settings import ModelRoute
from tests.gateway.fake_upstream import (
    HTTP,
    FakeUpstream,
    Reply,
    backend,
    metric_value,
    openai_client,
    running_gateway,
)
from tests.gateway.live import ADMIN_HEADERS, LiveGateway, free_port, readiness, wait_for

pytestmark = pytest.mark.timeout(60)

MODEL = "shared-model"
MESSAGES = [{"role": "user", "content": "Who are you?"}]
A_TEXT, B_TEXT = "I am backend A.", "I am backend B."


@pytest.fixture
def a() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=("a-model",), text=A_TEXT) as fake:
        yield fake


@pytest.fixture
def b() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=("b-model",), text=B_TEXT) as fake:
        yield fake


def pair(a: FakeUpstream, b: FakeUpstream, a_knobs: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A gateway with backends a, b (in that order) both serving MODEL."""
    return running_gateway(
        backend("a", a, models={MODEL: "a-model"}, **(a_knobs or {})),
        backend("b", b, models={MODEL: "b-model"}),
        **kw,
    )


def ask(live: LiveGateway, stream: bool) -> tuple[str, str]:
    """(text, serving backend) of one chat request through the openai client."""
    client = openai_client(live)
    if stream:
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))  # type: ignore[arg-type]
        assert all(c.model == MODEL for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(final) == 1
        return text, (final[0].model_extra or {})["metrics"]["route"]["backend"]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert resp.model == MODEL
    return resp.choices[0].message.content or "", (resp.model_extra or {})["metrics"]["route"]["backend"]


def readyz(live: LiveGateway) -> dict[str, Any]:
    return readiness(live.url)


def breaker(live: LiveGateway, name: str) -> str:
    return str(readyz(live)["backends"][name]["breaker"])


def metrics(live: LiveGateway) -> str:
    return HTTP.get(f"{live.url}/metrics").text


# ---- failover before the first byte --------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_fails_over_when_the_first_backend_is_refusing_connections(
    a: FakeUpstream, b: FakeUpstream, stream: bool
) -> None:
    # a is up when the gateway starts (healthy, first in order), then goes away.
    with pair(a, b, a_knobs={"breaker_failures": 10, "max_retries": 1}) as live:
        a.stop()
        first = ask(live, stream)
        second = ask(live, not stream)
        text = metrics(live)
    assert first == (B_TEXT, "b") and second == (B_TEXT, "b")
    assert len(b.posts()) == 2
    assert metric_value(text, "specgate_failovers_total", model=MODEL) == 2.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_down_from_the_start_is_tried_last(a: FakeUpstream, b: FakeUpstream, stream: bool) -> None:
    a.models_status = 503  # a's health probe fails at start-up
    with pair(a, b) as live:
        state = readyz(live)["backends"]["a"]
        served = ask(live, stream)
    assert state["probe_ok"] is False and state["healthy"] is False
    assert served == (B_TEXT, "b")
    assert a.posts() == []  # b answered, so a was never needed


def test_configured_route_order_is_followed(a: FakeUpstream, b: FakeUpstream) -> None:
    with pair(a, b, routes={MODEL: ModelRoute(backends=["b", "a"])}) as live:
        assert ask(live, False) == (B_TEXT, "b")
        b.script(Reply.error(503), Reply.error(503), Reply.error(503))
        assert ask(live, False) == (A_TEXT, "a")
    assert len(b.posts()) == 4 and len(a.posts()) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_fails_over_after_server_errors_exhaust_the_retries(
    a: FakeUpstream, b: FakeUpstream, stream: bool
) -> None:
    a.script(Reply.error(500), Reply.error(502), Reply.error(503))
    with pair(a, b, a_knobs={"max_retries": 2}) as live:
        assert ask(live, stream) == (B_TEXT, "b")
    assert len(a.posts()) == 3 and len(b.posts()) == 1


def test_a_long_retry_after_moves_on_to_the_next_backend_at_once(a: FakeUpstream, b: FakeUpstream) -> None:
    a.script(Reply.error(429, "busy", type="rate_limit_error", retry_after="30"))
    with pair(a, b, a_knobs={"max_retry_wait": 2.0}) as live:
        t0 = time.monotonic()
        served = ask(live, False)
        elapsed = time.monotonic() - t0
    assert served == (B_TEXT, "b")
    assert elapsed < 1.5
    assert len(a.posts()) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_a_hung_backend_fails_over_after_its_read_timeout(
    a: FakeUpstream, b: FakeUpstream, stream: bool
) -> None:
    a.script(Reply.hang())
    with pair(a, b, a_knobs={"read_timeout": 0.3, "max_retries": 0}) as live:
        t0 = time.monotonic()
        served = ask(live, stream)
        elapsed = time.monotonic() - t0
    assert served == (B_TEXT, "b")
    assert 0.25 <= elapsed < 5.0


@pytest.mark.parametrize("stream", [False, True])
def test_client_errors_do_not_fail_over(a: FakeUpstream, b: FakeUpstream, stream: bool) -> None:
    a.script(Reply.error(400, "prompt too long", type="invalid_request_error", param="messages"))
    with pair(a, b) as live, pytest.raises(openai.BadRequestError) as exc:
        ask(live, stream)
    assert isinstance(exc.value.body, dict) and exc.value.body["message"] == "prompt too long"
    assert b.posts() == []


def test_no_failover_once_the_stream_started(a: FakeUpstream, b: FakeUpstream) -> None:
    a.script(Reply.stream_error(after=2, message="GPU fell off the bus"))
    with pair(a, b) as live:
        got: list[str] = []
        with pytest.raises(openai.APIError) as exc:
            for c in openai_client(live).chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):  # type: ignore[arg-type]
                if c.choices:
                    got.append(c.choices[0].delta.content or "")
    assert "GPU fell off the bus" in exc.value.message
    assert "".join(got) == "I am"  # a's first two words, and nothing of b's
    assert b.posts() == []


# ---- nobody can serve ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_all_backends_down_is_503_with_retry_after(stream: bool) -> None:
    a, b = FakeUpstream(port=free_port()), FakeUpstream(port=free_port())  # never started: refused
    with running_gateway(
        backend("a", a, models=[MODEL]),
        backend("b", b, models=[MODEL]),
        wait_ready=False,
        retry_after_seconds=7,
    ) as live:
        body = {"model": MODEL, "messages": MESSAGES, "stream": stream}
        r = HTTP.post(f"{live.url}/v1/chat/completions", json=body)
        ready = HTTP.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
        with pytest.raises(openai.InternalServerError) as exc:
            ask(live, stream)
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers["retry-after"] == "7"
    assert r.headers["x-request-id"]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable"
    assert err["code"] == "backends_unavailable"
    assert "backend a" in err["message"] and "backend b" in err["message"]
    assert "Traceback" not in err["message"]
    assert exc.value.status_code == 503
    assert ready.status_code == 503
    assert ready.json()["status"] == "not_ready"
    assert {n: s["healthy"] for n, s in ready.json()["backends"].items()} == {"a": False, "b": False}


# ---- breakers ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_breaker_opens_after_repeated_failures_and_closes_after_the_cooldown(
    a: FakeUpstream, b: FakeUpstream
) -> None:
    cooldown = 0.5
    a.script(Reply.error(503, "overloaded"), Reply.error(503, "overloaded"))
    a_knobs = {"max_retries": 0, "breaker_failures": 2, "breaker_cooldown": cooldown, "health_interval": 0}
    with pair(a, b, a_knobs=a_knobs) as live:
        assert metric_value(metrics(live), "specgate_backend_breaker_open", backend="a") == 0.0
        assert [ask(live, False), ask(live, True)] == [(B_TEXT, "b")] * 2  # each failed over from a
        opened_at = time.monotonic()
        state = readyz(live)["backends"]["a"]
        text = metrics(live)
        # While open, a gets nothing: b serves directly.
        served_while_open = ask(live, False)
        still_open = time.monotonic() - opened_at < cooldown
        assert still_open, "the test was too slow to see the open state; raise the cooldown"
        assert served_while_open == (B_TEXT, "b")
        assert len(a.posts()) == 2
        # After the cooldown a trial request goes to a (first in order) and closes the breaker.
        assert wait_for(lambda: breaker(live, "a") == "half_open", 5)
        served = ask(live, True)
        closed = readyz(live)["backends"]["a"]
        text_after = metrics(live)
    assert state["breaker"] == "open" and state["healthy"] is False
    assert metric_value(text, "specgate_backend_breaker_open", backend="a") == 1.0
    assert metric_value(text, "specgate_backend_up", backend="a") == 0.0
    assert metric_value(text, "specgate_backend_breaker_open", backend="b") == 0.0
    assert served == (A_TEXT, "a")
    assert closed["breaker"] == "closed" and closed["healthy"] is True
    assert metric_value(text_after, "specgate_backend_breaker_open", backend="a") == 0.0
    assert metric_value(text_after, "specgate_backend_up", backend="a") == 1.0


@pytest.mark.slow
def test_failed_trial_reopens_the_breaker(a: FakeUpstream, b: FakeUpstream) -> None:
    cooldown = 0.3
    a.script(Reply.error(503), Reply.error(503))
    a_knobs = {"max_retries": 0, "breaker_failures": 1, "breaker_cooldown": cooldown, "health_interval": 0}
    with pair(a, b, a_knobs=a_knobs) as live:
        assert ask(live, False) == (B_TEXT, "b")
        assert wait_for(lambda: breaker(live, "a") == "half_open", 5)
        assert ask(live, False) == (B_TEXT, "b")  # the trial failed, b served
        reopened = breaker(live, "a")
        assert wait_for(lambda: breaker(live, "a") == "half_open", 5)
        assert ask(live, False) == (A_TEXT, "a")
    assert reopened == "open"
    assert len(a.posts()) == 3


@pytest.mark.timeout(30)
def test_health_probe_closes_the_breaker_when_the_backend_comes_back(a: FakeUpstream) -> None:
    # A long cooldown: only the health probe can close this breaker within the test.
    knobs = {"max_retries": 0, "breaker_failures": 1, "breaker_cooldown": 60.0, "health_interval": 0.1}
    with running_gateway(backend("a", a, models={MODEL: "a-model"}, **knobs)) as live:
        a.stop()
        r = HTTP.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 503
        assert breaker(live, "a") == "open"
        assert wait_for(lambda: readyz(live)["backends"]["a"]["probe_ok"] is False, 5)
        refused = HTTP.post(f"{live.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        a.start()  # the same port
        assert wait_for(lambda: breaker(live, "a") == "closed", 5), readyz(live)["backends"]["a"]
        ready = HTTP.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
        served = ask(live, False)
    assert refused.status_code == 503 and "circuit open" in refused.json()["error"]["message"]
    assert ready.status_code == 200 and ready.json()["backends"]["a"]["healthy"] is True
    assert served == (A_TEXT, "a")


def test_without_background_probes_a_failed_startup_probe_does_not_stick(a: FakeUpstream) -> None:
    """health_interval=0 disables background probes, so the start-up probe is the only one. A backend
    that failed it but then serves requests must count as healthy again (readiness, ordering)."""
    a.models_status = 503  # down (for the probe) when the gateway starts
    with running_gateway(
        backend("a", a, models={MODEL: "a-model"}, health_interval=0), wait_ready=False
    ) as live:
        before = HTTP.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
        a.models_status = 200
        served = [ask(live, False), ask(live, True)]
        after = HTTP.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
    assert before.status_code == 503
    assert served == [(A_TEXT, "a")] * 2  # it serves fine
    assert after.json()["backends"]["a"]["healthy"] is True, after.json()["backends"]["a"]
    assert after.status_code == 200
