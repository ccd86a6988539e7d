"""One external OpenAI-compatible backend behind a live gateway, seen through the official `openai` client.

The upstream is a scripted fake (tests/gateway/fake_upstream.py): it answers normally unless told to
fail, and records what the gateway sent it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from specgate.gateway.settings import Settings
from tests.gateway.fake_upstream import (
    HTTP,
    PROMPT_TOKENS,
    FakeUpstream,
    Reply,
    backend,
    external_settings,
    metric_value,
    openai_client,
    running_gateway,
)
from tests.gateway.live import ADMIN_HEADERS, LiveGateway, readiness, record_of, start_gateway, wait_for

pytestmark = pytest.mark.timeout(60)

PUBLIC, UPSTREAM = "public-model", "upstream-model"
MESSAGES = [{"role": "user", "content": "Say hello"}]


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    """A fresh upstream, for tests that need a gateway with knobs of their own."""
    with FakeUpstream(models=(UPSTREAM,)) as upstream:
        yield upstream


def serve(fake: FakeUpstream, **knobs: Any) -> Any:
    """A gateway whose one backend `up` serves PUBLIC as the fake's UPSTREAM."""
    knobs.setdefault("models", {PUBLIC: UPSTREAM})
    return running_gateway(backend("up", fake, **knobs))


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[LiveGateway, FakeUpstream]]:
    with FakeUpstream(models=(UPSTREAM,)) as upstream, serve(upstream, api_key="upstream-secret") as live:
        yield live, upstream


@pytest.fixture
def shared(shared_pair: tuple[LiveGateway, FakeUpstream]) -> tuple[LiveGateway, FakeUpstream]:
    """A gateway with the default test knobs (max_retries=2) over one upstream, both shared by the
    tests of this module that leave its breaker closed; the upstream starts each test unscripted."""
    live, upstream = shared_pair
    upstream.reset()
    assert readyz(live)["backends"]["up"]["breaker"] == "closed", "an earlier test left the breaker open"
    return live, upstream


def chat(live: LiveGateway, **kw: Any) -> httpx.Response:
    body = {"model": PUBLIC, "messages": MESSAGES, **kw}
    return HTTP.post(f"{live.url}/v1/chat/completions", json=body)


def sse_events(raw: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except for [DONE]."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def readyz(live: LiveGateway) -> dict[str, Any]:
    return readiness(live.url)


def metrics_text(live: LiveGateway) -> str:
    return HTTP.get(f"{live.url}/metrics").text


Shared = tuple[LiveGateway, FakeUpstream]


# ---- the happy path: mapping, relaying, passthrough ----------------------------------------------


def test_chat_maps_the_model_name_upstream_and_back(shared: Shared) -> None:
    live, fake = shared
    client = openai_client(live)
    resp = client.chat.completions.create(model=PUBLIC, messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
    assert resp.model == PUBLIC
    assert resp.choices[0].message.content == fake.text
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (PROMPT_TOKENS, 5)
    assert (resp.model_extra or {})["metrics"]["route"]["backend"] == "up"
    (sent,) = fake.posts("/chat/completions")
    assert sent.body["model"] == UPSTREAM
    assert sent.body["messages"] == MESSAGES and sent.body["max_tokens"] == 5
    # The backend's own key goes upstream; the client's key does not.
    assert sent.headers["authorization"] == "Bearer upstream-secret"
    assert not any("client-key" in v for v in sent.headers.values())
    assert [m.id for m in client.models.list()] == [PUBLIC]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_map_the_model_name(shared: Shared, stream: bool) -> None:
    live, fake = shared
    client = openai_client(live)
    if stream:
        chunks = list(client.completions.create(model=PUBLIC, prompt="Once upon", max_tokens=4, stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        models = {c.model for c in chunks}
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        resp = client.completions.create(model=PUBLIC, prompt="Once upon", max_tokens=4)
        text, models, finish = resp.choices[0].text, {resp.model}, resp.choices[0].finish_reason
    assert text == fake.text
    assert models == {PUBLIC}
    assert finish == "stop"
    (sent,) = fake.posts()
    assert sent.path == "/v1/completions"
    assert (
        sent.body["model"] == UPSTREAM and sent.body["prompt"] == "Once upon" and sent.body["max_tokens"] == 4
    )


def test_stream_is_relayed_and_the_usage_the_gateway_asked_for_is_dropped(shared: Shared) -> None:
    live, fake = shared
    chunks = list(
        openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == fake.text
    assert all(c.model == PUBLIC for c in chunks)
    assert all(c.choices for c in chunks), "a usage-only chunk reached a client that did not ask for usage"
    assert chunks[-1].choices[0].finish_reason == "stop"
    (sent,) = fake.posts()
    assert sent.body["stream"] is True
    assert sent.body["stream_options"] == {"include_usage": True}  # the gateway always counts tokens


def test_stream_usage_reaches_a_client_that_asks_for_it(shared: Shared) -> None:
    live, fake = shared
    options = {"include_usage": True, "continuous_usage_stats": False}  # a vendor key rides along
    chunks = list(
        openai_client(live).chat.completions.create(
            model=PUBLIC,
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            extra_body={"stream_options": options},
        )
    )
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, 5)
    assert sum(1 for c in chunks if c.usage is not None) == 1
    assert all(c.model == PUBLIC for c in chunks)
    (sent,) = fake.posts()
    assert sent.body["stream_options"] == options


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "strict": True,
        },
    }
]
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
VENDOR = {
    "top_k": 20,
    "repetition_penalty": 1.05,
    "chat_template_kwargs": {"enable_thinking": False},
    "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}},
    # Structured outputs reach an external backend as sent: keys specgate does not know included.
    "structured_outputs": {"json": {"type": "object"}, "disable_fallback": True, "newer_vllm_key": [1]},
    "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
    "vendor_blob": {"nested": [1, {"x": None}, "y"]},
    "priority": -3,
}


@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_vendor_fields_pass_through_but_spec_does_not(shared: Shared, stream: bool) -> None:
    live, fake = shared
    messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    fake.script(Reply.ok(tool_calls=[TOOL_CALL]))
    kwargs: dict[str, Any] = dict(
        model=PUBLIC,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        logit_bias={"42": -100},
        seed=7,
        extra_body={**VENDOR, "spec": {"method": "ngram", "k_max": 4}},
    )
    client = openai_client(live)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [tc.function.name for tc in calls if tc.function] == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        resp = client.chat.completions.create(**kwargs)
        got = resp.choices[0].message.tool_calls
        assert got is not None and got[0].function.name == "get_weather"  # type: ignore[union-attr]
        assert got[0].function.arguments == '{"city": "Oslo"}'  # type: ignore[union-attr]
        assert resp.choices[0].finish_reason == "tool_calls"
    (sent,) = fake.posts()
    body = sent.body
    assert body["messages"] == messages
    assert body["tools"] == TOOLS
    assert body["tool_choice"] == tool_choice
    assert body["parallel_tool_calls"] is False
    assert body["logit_bias"] == {"42": -100}
    assert body["seed"] == 7
    for key, value in VENDOR.items():
        assert body[key] == value, key
    assert "spec" not in body  # specgate's own extension stays here


@pytest.mark.parametrize("stream", [False, True])
def test_numbers_past_64_bits_and_unicode_pass_through_exactly(shared: Shared, stream: bool) -> None:
    # The fast JSON path must not round what it does not understand: vendor fields travel as sent.
    live, fake = shared
    big, negative = 2**70 + 1, -(2**64) - 3
    fake.script(Reply.ok(extra={"x_vendor": {"n": big, "m": negative, "t": "é\u2028😀"}}))
    body = {
        "model": PUBLIC,
        "messages": [{"role": "user", "content": "hi 😀"}],
        "x_trace": {"n": big, "m": negative},
        "stream": stream,
    }
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        last = [e for e in sse_events(r.text) if isinstance(e, dict) and "x_vendor" in e]
        assert last and last[-1]["x_vendor"] == {"n": big, "m": negative, "t": "é\u2028😀"}
    else:
        assert r.json()["x_vendor"] == {"n": big, "m": negative, "t": "é\u2028😀"}
    (sent,) = fake.posts()
    assert sent.body["x_trace"] == {"n": big, "m": negative}
    assert sent.body["messages"][0]["content"] == "hi 😀"


# ---- retries -------------------------------------------------------------------------------------


def test_server_errors_are_retried_invisibly(shared: Shared) -> None:
    live, fake = shared
    fake.script(Reply.error(500), Reply.error(503))
    resp = openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == fake.text
    assert len(fake.posts()) == 3
    assert all(p.body["model"] == UPSTREAM for p in fake.posts())


def test_a_dropped_connection_is_retried_invisibly(shared: Shared) -> None:
    live, fake = shared
    fake.script(Reply.drop(), Reply.drop())
    chunks = list(
        openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == fake.text
    assert len(fake.posts()) == 3


def test_attempts_metric_counts_retries(shared: Shared) -> None:
    live, fake = shared
    before = metric_value(metrics_text(live), "specgate_backend_attempts_total", backend="up") or 0.0
    fake.script(Reply.error(503), Reply.error(503))
    assert chat(live).status_code == 200
    after = metric_value(metrics_text(live), "specgate_backend_attempts_total", backend="up")
    # specgate_backend_attempts: "Upstream attempts, retries included", per backend.
    assert after is not None and after - before == 3.0


@pytest.mark.slow
def test_retry_after_is_honoured(shared: Shared) -> None:
    live, fake = shared  # retry_backoff 0.01 s, max_retry_wait 2 s
    fake.script(Reply.error(429, "slow down", type="rate_limit_error", retry_after="1"))
    t0 = time.monotonic()
    resp = openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    assert resp.choices[0].message.content == fake.text
    assert len(fake.posts()) == 2
    assert 0.9 <= elapsed < 4.0, elapsed  # the backoff alone would have been 0.01 s


def test_a_retry_after_beyond_max_retry_wait_is_not_waited_for(shared: Shared) -> None:
    live, fake = shared  # max_retry_wait 2 s
    fake.script(Reply.error(429, "slow down", type="rate_limit_error", code="rate_limited", retry_after="30"))
    t0 = time.monotonic()
    r = chat(live)
    elapsed = time.monotonic() - t0
    assert r.status_code == 429
    assert elapsed < 1.5
    assert r.headers["retry-after"] == "30"
    assert r.json()["error"]["message"] == "slow down"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert len(fake.posts()) == 1
    # The openai client maps it to its RateLimitError.
    fake.script(Reply.error(429, "slow down", type="rate_limit_error", retry_after="30"))
    with pytest.raises(openai.RateLimitError) as exc:
        openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    assert exc.value.status_code == 429 and "slow down" in exc.value.message


def test_retries_give_up_after_max_retries(fake: FakeUpstream) -> None:
    fake.script(*[Reply.error(503, "still warming up")] * 3, Reply.ok("never reached"))
    with serve(fake, max_retries=2) as live, pytest.raises(openai.InternalServerError) as exc:
        openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    assert exc.value.status_code == 503
    assert "still warming up" in exc.value.message
    assert exc.value.response.headers.get("retry-after") is not None
    assert exc.value.response.headers.get("x-request-id")
    assert len(fake.posts()) == 3


# ---- client errors pass through untouched --------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "exc_class"),
    [
        (400, openai.BadRequestError),
        (404, openai.NotFoundError),
        (409, openai.ConflictError),
        (422, openai.UnprocessableEntityError),
    ],
)
def test_upstream_client_errors_pass_through(shared: Shared, status: int, exc_class: type) -> None:
    live, fake = shared
    msg = "This model's maximum context length is 2048 tokens."
    fake.script(
        Reply.error(
            status, msg, type="invalid_request_error", code="context_length_exceeded", param="messages"
        )
    )
    with pytest.raises(exc_class) as exc:
        openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    err = exc.value
    assert err.status_code == status
    assert isinstance(err.body, dict) and err.body["message"] == msg
    assert err.code == "context_length_exceeded"
    assert err.param == "messages"
    assert err.type == "invalid_request_error"
    assert err.response.headers.get("x-request-id")
    assert len(fake.posts()) == 1  # not retried


def test_client_errors_do_not_count_against_the_breaker(fake: FakeUpstream) -> None:
    fake.script(*[Reply.error(400, "bad request", type="invalid_request_error")] * 3)
    with serve(fake, breaker_failures=1) as live:
        assert [chat(live).status_code for _ in range(3)] == [400, 400, 400]
        state = readyz(live)["backends"]["up"]
        after = chat(live)
    assert state["breaker"] == "closed" and state["healthy"] is True
    assert after.status_code == 200


def test_upstream_client_error_on_a_stream_request_is_a_plain_error_response(shared: Shared) -> None:
    live, fake = shared
    fake.script(Reply.error(400, "bad stop sequence", type="invalid_request_error", param="stop"))
    r = chat(live, stream=True)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"] == {
        "message": "bad stop sequence",
        "type": "invalid_request_error",
        "param": "stop",
        "code": None,
    }


# ---- request ids ---------------------------------------------------------------------------------


def test_every_response_carries_x_request_id(shared: Shared) -> None:
    live, fake = shared
    fake.script(
        Reply.error(400, "nope", type="invalid_request_error"),
        Reply.error(429, "later", type="rate_limit_error", retry_after="60"),
    )
    url = f"{live.url}/v1/chat/completions"
    bad = chat(live)
    limited = chat(live)
    ok = chat(live, max_tokens=3)
    unknown = HTTP.post(url, json={"model": "no-such-model", "messages": MESSAGES})
    body = {"model": PUBLIC, "messages": MESSAGES, "stream": True}
    with HTTP.stream("POST", url, json=body, headers={"x-request-id": "trace-42.a:b"}) as streamed:
        streamed.read()
    echoed = HTTP.post(url, json={"model": PUBLIC, "messages": MESSAGES}, headers={"x-request-id": "my-id-1"})
    assert [r.status_code for r in (bad, limited, ok, unknown, streamed, echoed)] == [
        400,
        429,
        200,
        404,
        200,
        200,
    ]
    ids = [r.headers.get("x-request-id") for r in (bad, limited, ok, unknown)]
    assert all(ids) and len(set(ids)) == 4
    assert streamed.headers["x-request-id"] == "trace-42.a:b"
    assert echoed.headers["x-request-id"] == "my-id-1"


# ---- failures after the stream started -----------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [Reply.stream_error(after=2, message="upstream exploded"), Reply.stream_drop(after=2)],
    ids=["error-event", "dropped-connection"],
)
def test_failure_after_the_stream_started_is_an_error_event(shared: Shared, reply: Reply) -> None:
    live, fake = shared
    fake.script(reply, reply)
    got: list[str] = []
    with pytest.raises(openai.APIError) as exc:
        stream = openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        for c in stream:
            if c.choices:
                got.append(c.choices[0].delta.content or "")
    body = {"model": PUBLIC, "messages": MESSAGES, "stream": True}
    with HTTP.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    after = chat(live)
    assert "".join(got) == "Hello from"  # what arrived before the failure was delivered
    if reply.kind == "stream_error":
        assert "upstream exploded" in exc.value.message
    assert r.status_code == 200
    assert "[DONE]" not in events
    assert set(events[-1]) == {"error"}
    assert set(events[-1]["error"]) == {"message", "type", "param", "code"}
    assert len(events) == 4 and all("choices" in e for e in events[:-1])
    assert len(fake.posts()) == 3  # once the stream started, no retry
    assert after.status_code == 200  # and the next request is fine


# ---- timeouts ------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.slow
def test_a_hung_upstream_times_out_with_503(fake: FakeUpstream) -> None:
    fake.script(Reply.hang())
    with serve(fake, read_timeout=0.5, max_retries=0) as live:
        t0 = time.monotonic()
        r = chat(live)
        elapsed = time.monotonic() - t0
        after = chat(live)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable"
    assert r.headers["retry-after"]
    assert 0.4 <= elapsed < 5.0
    assert after.status_code == 200


# ---- what upstreams report about themselves ------------------------------------------------------

LLAMA_TIMINGS = {"prompt_n": 7, "predicted_n": 5, "predicted_ms": 50.0, "draft_n": 10, "draft_n_accepted": 7}
VLLM_METRICS = {"arrival_time": 1.0, "time_in_queue": 0.01, "spec_token_acceptance_counts": [4, 3, 2]}


def final_metrics(live: LiveGateway, stream: bool) -> dict[str, Any]:
    """The `metrics` object of a response, or of the stream chunk that carries the finish reason."""
    r = chat(live, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        metrics: dict[str, Any] = r.json()["metrics"]
        return metrics
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    finals = [e for e in events[:-1] if e["choices"] and e["choices"][0].get("finish_reason")]
    assert len(finals) == 1
    assert "metrics" in finals[0]
    return dict(finals[0]["metrics"])


@pytest.mark.parametrize("stream", [False, True])
def test_llama_cpp_timings_become_speculation_metrics(shared: Shared, stream: bool) -> None:
    live, fake = shared
    fake.script(Reply.ok(extra={"timings": LLAMA_TIMINGS}))
    metrics = final_metrics(live, stream)
    assert metrics["route"]["backend"] == "up"
    assert metrics["upstream"] == {"timings": LLAMA_TIMINGS}
    spec = metrics["spec_decoding"]
    assert spec["method"] == "upstream:llama.cpp"
    assert (spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (10, 7)


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_vllm_metrics_do_not_replace_the_gateways_own(shared: Shared, stream: bool) -> None:
    """vLLM's per-request `metrics` has the name of specgate's extension: the client must still get
    specgate's object (its route) with vLLM's nested under `upstream`, streaming or not."""
    live, fake = shared
    fake.script(Reply.ok(extra={"metrics": VLLM_METRICS}))
    metrics = final_metrics(live, stream)
    assert metrics.get("route", {}).get("backend") == "up", metrics
    assert metrics["upstream"] == {"metrics": VLLM_METRICS}
    assert metrics["spec_decoding"]["method"] == "upstream:vllm"
    assert metrics["spec_decoding"]["num_accepted_tokens"] == 5


def test_models_are_discovered_by_the_health_probe(fake: FakeUpstream) -> None:
    with serve(fake, models={}) as live:
        listed = HTTP.get(f"{live.url}/v1/models").json()["data"]
        resp = openai_client(live).chat.completions.create(model=UPSTREAM, messages=MESSAGES)  # type: ignore[arg-type]
    assert [(m["id"], m["backends"]) for m in listed] == [(UPSTREAM, ["up"])]
    assert fake.probes >= 1
    assert resp.model == UPSTREAM
    assert fake.posts()[0].body["model"] == UPSTREAM


# ---- the breaker of a single backend -------------------------------------------------------------


def test_open_breaker_answers_503_without_calling_upstream(fake: FakeUpstream) -> None:
    fake.script(Reply.error(502), Reply.error(502))
    with serve(fake, max_retries=0, breaker_failures=2, breaker_cooldown=5.0) as live:
        assert [chat(live).status_code for _ in range(2)] == [502, 502]
        r = chat(live)
        ready = HTTP.get(f"{live.url}/readyz", headers=ADMIN_HEADERS)
        text = metrics_text(live)
    assert r.status_code == 503
    assert "circuit open" in r.json()["error"]["message"]
    assert r.headers["retry-after"] in {"4", "5"}  # what is left of the cooldown
    assert len(fake.posts()) == 2  # the third request never left the gateway
    assert ready.status_code == 503  # the only model has no healthy backend
    assert ready.json()["backends"]["up"]["breaker"] == "open"
    assert ready.json()["backends"]["up"]["healthy"] is False
    assert metric_value(text, "specgate_backend_breaker_open", backend="up") == 1.0
    assert metric_value(text, "specgate_backend_up", backend="up") == 0.0


def _abandon_trial_by_disconnecting(live: LiveGateway, fake: FakeUpstream, stream: bool) -> None:
    fake.script(Reply.hang())
    body = {"model": PUBLIC, "messages": MESSAGES, "stream": stream}
    with (
        pytest.raises(httpx.ReadTimeout),
        HTTP.stream(
            "POST", f"{live.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=0.5)
        ) as r,
    ):
        r.read()


def _trial_ends_with_an_error_event(live: LiveGateway, fake: FakeUpstream, stream: bool) -> None:
    fake.script(Reply.stream_error(after=1))
    body = {"model": PUBLIC, "messages": MESSAGES, "stream": True}
    with HTTP.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
        assert "error" in sse_events(r.read().decode())[-1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("how", "stream"),
    [
        (_abandon_trial_by_disconnecting, False),
        (_abandon_trial_by_disconnecting, True),
        (_trial_ends_with_an_error_event, True),
    ],
    ids=["client-left-during-trial", "client-left-during-streamed-trial", "error-event-in-trial"],
)
@pytest.mark.slow
def test_a_half_open_trial_that_ends_oddly_does_not_wedge_the_breaker(
    fake: FakeUpstream, how: Any, stream: bool
) -> None:
    """Half-open lets one trial through. However that trial ends, the breaker must come back:
    once the upstream is healthy again, requests must get through within a few cooldowns."""
    cooldown = 0.3
    fake.script(Reply.error(503))
    with serve(fake, max_retries=0, breaker_failures=1, breaker_cooldown=cooldown, health_interval=0) as live:
        assert chat(live).status_code == 503  # opens the breaker
        assert wait_for(lambda: readyz(live)["backends"]["up"]["breaker"] == "half_open", 3)
        how(live, fake, stream)  # the trial
        assert len(fake.posts()) == 2, "the trial did not reach the upstream"
        # The upstream answers normally from now on.
        recovered = wait_for(
            lambda: chat(live).status_code == 200, timeout=5 * cooldown, interval=cooldown / 3
        )
        assert recovered, f"breaker stuck: {readyz(live)['backends']['up']}"


# ---- prefix-cache hits and cache_salt ------------------------------------------------------------


def _prefix_counters(live: LiveGateway) -> tuple[float, float]:
    text = metrics_text(live)
    labels = {"model": PUBLIC, "backend": "up"}
    queried = metric_value(text, "specgate_prefix_cache_queried_tokens_total", **labels) or 0.0
    hits = metric_value(text, "specgate_prefix_cache_hit_tokens_total", **labels) or 0.0
    return queried, hits


def _usage_of(live: LiveGateway, rid: str, stream: bool, kind: str = "chat") -> Any:
    """The usage the client got (the body's, or the usage chunk's), as raw JSON."""
    body: dict[str, Any] = {"model": PUBLIC}
    body.update({"messages": MESSAGES} if kind == "chat" else {"prompt": "Once upon"})
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    headers = {"x-request-id": rid}
    if not stream:
        r = HTTP.post(f"{live.url}{path}", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body.update(stream=True, stream_options={"include_usage": True})
    r = HTTP.post(f"{live.url}{path}", json=body, headers=headers)
    assert r.status_code == 200, r.text
    usages = [e["usage"] for e in sse_events(r.text) if isinstance(e, dict) and e.get("usage")]
    assert len(usages) == 1
    return usages[0]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_an_upstream_reports_pass_through(shared: Shared, stream: bool, kind: str) -> None:
    live, fake = shared
    before = _prefix_counters(live)
    fake.script(Reply.ok(usage={"prompt_tokens_details": {"cached_tokens": 5, "audio_tokens": 0}}))
    rid = f"cached-{kind}-{stream}-{uuid.uuid4().hex}"
    use = _usage_of(live, rid, stream, kind)
    assert use["prompt_tokens"] == PROMPT_TOKENS
    assert use["prompt_tokens_details"] == {"cached_tokens": 5, "audio_tokens": 0}  # as sent
    assert record_of(live, rid).cached_tokens == 5
    after = _prefix_counters(live)
    assert (after[0] - before[0], after[1] - before[1]) == (PROMPT_TOKENS, 5)


def test_the_openai_client_reads_passed_through_cached_tokens(shared: Shared) -> None:
    live, fake = shared
    fake.script(Reply.ok(usage={"prompt_tokens_details": {"cached_tokens": 3}}))
    resp = openai_client(live).chat.completions.create(model=PUBLIC, messages=MESSAGES)  # type: ignore[arg-type]
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_not_invented_for_an_upstream_that_does_not_report_them(
    shared: Shared, stream: bool
) -> None:
    live, _ = shared
    before = _prefix_counters(live)
    rid = f"uncached-{stream}-{uuid.uuid4().hex}"
    use = _usage_of(live, rid, stream)
    assert "prompt_tokens_details" not in use
    assert record_of(live, rid).cached_tokens is None
    assert _prefix_counters(live) == before  # no report: neither queried nor hit


@pytest.mark.parametrize(
    "details",
    [
        {"cached_tokens": -1},
        {"cached_tokens": PROMPT_TOKENS + 1},  # more than the prompt
        {"cached_tokens": "5"},
        {"cached_tokens": True},
        {"cached_tokens": 5.0},
        {"cached_tokens": 2**40},
        {"cached_tokens": {"n": 5}},
        "five",
        [5],
    ],
    ids=repr,
)
@pytest.mark.parametrize("stream", [False, True])
def test_impossible_cached_tokens_are_dropped_not_fatal(shared: Shared, stream: bool, details: Any) -> None:
    live, fake = shared
    before = _prefix_counters(live)
    fake.script(Reply.ok(usage={"prompt_tokens_details": details}))
    rid = f"bad-cached-{stream}-{uuid.uuid4().hex}"
    use = _usage_of(live, rid, stream)
    assert use["prompt_tokens"] == PROMPT_TOKENS  # the rest of the usage stands
    left = use.get("prompt_tokens_details")
    assert left is None or left.get("cached_tokens") is None
    assert record_of(live, rid).cached_tokens is None
    assert _prefix_counters(live) == before
    assert readyz(live)["backends"]["up"]["breaker"] == "closed"  # not the upstream's failure


def test_cache_salt_goes_upstream_only_when_sent_and_salted_per_tenant(fake: FakeUpstream) -> None:
    def sent_salts(live: LiveGateway, *calls: tuple[str, str | None]) -> list[Any]:
        fake.reset()
        for key, salt in calls:
            extra = {"cache_salt": salt} if salt is not None else {}
            r = HTTP.post(
                f"{live.url}/v1/chat/completions",
                json={"model": PUBLIC, "messages": MESSAGES, **extra},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
        return [p.body.get("cache_salt", "absent") for p in fake.posts()]

    with serve(fake, api_key=None) as open_live:
        salts = sent_salts(open_live, ("x", None), ("x", "team"), ("x", "team"), ("x", "other"))
    assert salts[0] == "absent"  # never added to a request that did not ask
    assert salts[1] == salts[2] != salts[3]  # the same salt is the same partition upstream, too
    assert "team" not in salts[1:] and all(s.startswith("salt:") for s in salts[1:])
    keyed = external_settings(backend("up", fake, models={PUBLIC: UPSTREAM}), api_keys=["k-alice", "k-bob"])
    live = start_gateway(keyed, timeout=30)
    try:
        alice, bob = sent_salts(live, ("k-alice", "team"), ("k-bob", "team"))
    finally:
        live.stop()
    assert alice != bob  # one salt under two keys: two partitions upstream


def test_with_prefix_sharing_off_each_salted_request_is_alone_upstream(fake: FakeUpstream) -> None:
    settings = Settings(
        embedded={"enabled": False, "prefix_cache_scope": "off"},
        backends=[backend("up", fake, models={PUBLIC: UPSTREAM})],
        port=0,
        log_requests=False,
    )
    live = start_gateway(settings, timeout=30)
    try:
        for _ in range(2):
            r = chat(live, cache_salt="team")
            assert r.status_code == 200, r.text
    finally:
        live.stop()
    first, second = (p.body["cache_salt"] for p in fake.posts())
    assert first != second and "team" not in (first, second)
