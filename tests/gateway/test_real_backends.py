"""The gateway in front of real backends nobody here wrote: llama.cpp's OpenAI-compatible server
(llama-cpp-python, on the embedded default model's GGUF file) and a second specgate (tiny model).

    front specgate --- "smollm2" ----------------> llama.cpp server
                   \\-- tiny model -------------> specgate (embedded engine)
                    \\- "shared": llama.cpp first, then the inner specgate

The last test kills the llama.cpp server mid-test, checks that traffic fails over and the breaker
opens, then starts it again on the same port and checks that the breaker closes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from specgate.gateway.settings import ModelRoute
from tests.gateway.fake_upstream import HTTP, backend, metric_value, openai_client, running_gateway
from tests.gateway.live import LiveGateway, readiness, start_gateway, tiny_settings, wait_for
from tests.gateway.llama_servers import LlamaServer

pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is a dev dependency")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LLAMA = "smollm2"
SHARED = "shared"
COOLDOWN = 1.0  # breaker cooldown of the front's backends


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = LlamaServer(tmp_path_factory.mktemp("llama"))
    server.spawn()  # `front` waits for it, after the inner gateway has loaded meanwhile
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


@pytest.fixture(scope="module")
def inner(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(tiny_settings(str(tiny_llama_dir), log_requests=False))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def front(llama: LlamaServer, inner: LiveGateway, tiny: str) -> Iterator[LiveGateway]:
    llama.wait_ready()
    knobs: dict[str, Any] = dict(
        max_retries=0, breaker_failures=1, breaker_cooldown=COOLDOWN, health_interval=0, read_timeout=60
    )
    with running_gateway(
        backend("llama", llama.base_url, models={LLAMA: LLAMA, SHARED: LLAMA}, **knobs),
        backend("inner", f"{inner.url}/v1", models={tiny: tiny, SHARED: tiny}, **knobs),
        routes={SHARED: ModelRoute(backends=["llama", "inner"])},
    ) as live:
        yield live


def route_backend(body: Any) -> str:
    extra = body if isinstance(body, dict) else (body.model_extra or {})
    return str(extra["metrics"]["route"]["backend"])


def chat_stream(client: openai.OpenAI, **kw: Any) -> tuple[str, list[Any]]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def readyz_backend(live: LiveGateway, name: str) -> dict[str, Any]:
    state: dict[str, Any] = readiness(live.url)["backends"][name]
    return state


def requests_count(live: LiveGateway, **labels: str) -> float | None:
    return metric_value(HTTP.get(f"{live.url}/metrics").text, "specgate_requests_total", **labels)


# ---- listing -------------------------------------------------------------------------------------


def test_models_list_names_every_model_any_backend_serves(front: LiveGateway, tiny: str) -> None:
    ids = sorted(m.id for m in openai_client(front).models.list())
    cards = {m["id"]: m for m in HTTP.get(f"{front.url}/v1/models").json()["data"]}
    assert ids == sorted([LLAMA, SHARED, tiny])
    assert cards[LLAMA]["backends"] == ["llama"]
    assert cards[tiny]["backends"] == ["inner"]
    assert cards[SHARED]["backends"] == ["llama", "inner"]
    one = HTTP.get(f"{front.url}/v1/models/{SHARED}")
    assert one.status_code == 200 and one.json()["id"] == SHARED


# ---- llama.cpp -----------------------------------------------------------------------------------


def test_chat_through_llama_cpp_streamed_and_not(front: LiveGateway) -> None:
    client = openai_client(front, timeout=60)
    kw: dict[str, Any] = dict(
        model=LLAMA, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0.0
    )
    resp = client.chat.completions.create(**kw)
    text, chunks = chat_stream(client, **kw)
    assert resp.model == LLAMA
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage is not None and 1 <= resp.usage.completion_tokens <= 8
    assert route_backend(resp) == "llama"
    # Greedy decoding: the relayed stream says exactly what the non-streamed answer said.
    assert text == resp.choices[0].message.content
    assert all(c.model == LLAMA for c in chunks)
    assert all(c.choices for c in chunks)  # no usage chunk: the client did not ask for one
    finals = [c for c in chunks if c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    assert route_backend(finals[0]) == "llama"


def test_completions_through_llama_cpp(front: LiveGateway) -> None:
    client = openai_client(front, timeout=60)
    kw: dict[str, Any] = dict(model=LLAMA, prompt="The capital of France is", max_tokens=6, temperature=0.0)
    resp = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert resp.model == LLAMA and resp.choices[0].text
    assert resp.usage is not None and resp.usage.completion_tokens <= 6
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert {c.model for c in chunks} == {LLAMA}


def test_llama_cpp_client_error_passes_through(front: LiveGateway) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client(front).completions.create(model=LLAMA, prompt="hello " * 2100, max_tokens=4)
    assert exc.value.code == "context_length_exceeded"
    assert "maximum context length is 2048" in exc.value.message
    assert readyz_backend(front, "llama")["breaker"] == "closed"


# ---- another specgate ----------------------------------------------------------------------------


def test_tiny_model_through_the_inner_specgate(front: LiveGateway, tiny: str) -> None:
    client = openai_client(front, timeout=60)
    kw: dict[str, Any] = dict(
        model=tiny, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.0
    )
    r = HTTP.post(f"{front.url}/v1/chat/completions", json=kw)
    text, chunks = chat_stream(client, **kw)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == tiny
    assert body["metrics"]["route"]["backend"] == "inner"
    # The inner gateway's own `metrics` is kept, nested under `upstream`.
    assert body["metrics"]["upstream"]["metrics"]["route"]["backend"] == "embedded"
    assert text == body["choices"][0]["message"]["content"]  # greedy, so the same text
    assert {c.model for c in chunks} == {tiny}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_stream_metrics_through_the_inner_specgate_name_the_front_route(
    front: LiveGateway, tiny: str
) -> None:
    """The final chunk's `metrics` must be the front gateway's (route: inner), as in the
    non-streamed answer, not the inner gateway's own object (route: embedded)."""
    _, chunks = chat_stream(
        openai_client(front, timeout=60),
        model=tiny,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
    )
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    metrics = (final.model_extra or {})["metrics"]
    assert metrics["route"]["backend"] == "inner", metrics["route"]
    assert metrics["upstream"]["metrics"]["route"]["backend"] == "embedded"


# ---- a backend dies and comes back ---------------------------------------------------------------


def test_shared_model_fails_over_when_llama_cpp_dies_and_returns(
    front: LiveGateway, llama: LlamaServer
) -> None:
    client = openai_client(front, timeout=60)
    msgs = [{"role": "user", "content": "Hi"}]
    try:
        first = client.chat.completions.create(model=SHARED, messages=msgs, max_tokens=4)  # type: ignore[arg-type]
        assert route_backend(first) == "llama"

        llama.kill()
        t0 = time.monotonic()
        after = client.chat.completions.create(model=SHARED, messages=msgs, max_tokens=4)  # type: ignore[arg-type]
        state = readyz_backend(front, "llama")
        text = HTTP.get(f"{front.url}/metrics").text
        seen_open_in_time = time.monotonic() - t0 < COOLDOWN
        _, chunks = chat_stream(client, model=SHARED, messages=msgs, max_tokens=4)
        only_llama = HTTP.post(f"{front.url}/v1/chat/completions", json={"model": LLAMA, "messages": msgs})

        assert route_backend(after) == "inner" and after.model == SHARED
        assert seen_open_in_time, "too slow to see the breaker open; raise COOLDOWN"
        assert state["breaker"] == "open" and state["healthy"] is False
        assert metric_value(text, "specgate_backend_breaker_open", backend="llama") == 1.0
        assert metric_value(text, "specgate_failovers_total", model=SHARED) == 1.0
        assert len([c for c in chunks if c.choices and c.choices[0].finish_reason]) == 1
        assert {c.model for c in chunks} == {SHARED}
        # Both answers were the inner gateway's, and complete.
        served_by_inner = dict(endpoint="chat", model=SHARED, backend="inner", status="200", outcome="ok")
        assert wait_for(lambda: requests_count(front, **served_by_inner) == 2.0, 5)
        # A model only llama.cpp serves has nowhere to go.
        assert only_llama.status_code == 503
        assert only_llama.headers["retry-after"]
        assert set(only_llama.json()["error"]) == {"message", "type", "param", "code"}

        llama.start()  # the same port; this takes longer than the cooldown
        deadline = time.monotonic() + 10 * COOLDOWN
        while readyz_backend(front, "llama")["breaker"] == "open" and time.monotonic() < deadline:
            time.sleep(0.1)
        back = client.chat.completions.create(model=SHARED, messages=msgs, max_tokens=4)  # type: ignore[arg-type]
        assert route_backend(back) == "llama"  # the half-open trial went to llama and succeeded
        state = readyz_backend(front, "llama")
        assert state["breaker"] == "closed" and state["healthy"] is True
        text = HTTP.get(f"{front.url}/metrics").text
        assert metric_value(text, "specgate_backend_breaker_open", backend="llama") == 0.0
        assert client.chat.completions.create(model=LLAMA, messages=msgs, max_tokens=4).model == LLAMA  # type: ignore[arg-type]
    finally:
        if llama.proc is None:
            llama.start()
