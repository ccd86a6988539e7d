"""Every error is OpenAI-shaped with the right status and the right `openai` exception class."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.live import LiveGateway, record_of, records_settle, start_gateway, tiny_settings, wait_for

MESSAGES = [{"role": "user", "content": "hi"}]


def _shape(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "temperature": 3}, "temperature"),
        ({"messages": MESSAGES, "top_p": 0}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": MESSAGES, "top_logprobs": 3}, None),
        ({}, "messages"),
    ],
)
def test_invalid_parameters_are_400(
    gateway: LiveGateway, model_name: str, body: dict, param: str | None
) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": model_name, **body})
    assert r.status_code == 400, r.text
    err = _shape(r.json())
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"]


def test_openai_client_raises_bad_request(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, messages=MESSAGES, n=17)  # type: ignore[arg-type]
    assert exc.value.status_code == 400 and exc.value.body["param"] == "n"  # type: ignore[index]


def test_context_length_exceeded(client: openai.OpenAI, model_name: str) -> None:
    long = [{"role": "user", "content": "x" * 600}]  # the tiny model holds 512 positions
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model_name, messages=long, max_tokens=4)  # type: ignore[arg-type]
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc2:
        client.completions.create(model=model_name, prompt="hi", max_tokens=100_000)
    assert exc2.value.code == "context_length_exceeded"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)  # type: ignore[arg-type]
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_bad_json_and_unknown_routes(gateway: LiveGateway) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and _shape(r.json())["code"] == "invalid_json"
    r = httpx.get(f"{gateway.url}/v1/nothing-here")
    assert r.status_code == 404 and _shape(r.json())["type"] == "not_found_error"
    r = httpx.get(f"{gateway.url}/v1/chat/completions")
    assert r.status_code == 405
    _shape(r.json())


def test_body_too_large_is_413(gateway: LiveGateway, model_name: str) -> None:
    huge = {"model": model_name, "messages": [{"role": "user", "content": "x" * (5 * 2**20)}]}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=huge)
    assert r.status_code == 413 and _shape(r.json())["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no content-length: the limit is enforced while reading
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(6):
            yield b"x" * 2**20
        yield b'"}]}'

    r = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413


def test_engine_failure_is_a_clean_500_and_the_gateway_keeps_serving(
    gateway: LiveGateway, client: openai.OpenAI, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = gateway.services.registry.embedded.engine  # type: ignore[union-attr]
    real_step = engine.step
    calls = {"n": 0}

    def broken_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure with secret internals")
        return real_step()

    monkeypatch.setattr(engine, "step", broken_step)
    with pytest.raises(openai.InternalServerError) as exc:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4)
    assert "secret internals" not in str(exc.value) and "Traceback" not in str(exc.value)
    ok = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4)
    assert ok.usage.completion_tokens == 4  # type: ignore[union-attr]
    assert engine.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(str(tiny_llama_dir), api_keys=["k-good", "k-other", "k-refusals"], rate_limit_rpm=30)
    )
    yield live
    live.stop()


def test_api_keys(guarded: LiveGateway, model_name: str) -> None:
    bad = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="k-bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.code == "invalid_api_key"
    r = httpx.get(f"{guarded.url}/v1/models")  # no key at all
    assert r.status_code == 401 and _shape(r.json())["type"] == "authentication_error"
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="k-good", max_retries=0)
    assert [m.id for m in good.models.list().data] == [model_name]
    assert httpx.get(f"{guarded.url}/healthz").status_code == 200  # health stays open


def test_rate_limit_is_429_with_retry_after(guarded: LiveGateway) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="k-other", max_retries=0)
    with pytest.raises(openai.RateLimitError) as exc:
        for _ in range(20):  # 30 rpm allows a burst of 5
            client.models.list()
    assert int(exc.value.response.headers["retry-after"]) >= 1
    assert exc.value.code == "rate_limit_exceeded"


def test_keys_never_reach_the_logs(
    guarded: LiveGateway, caplog: pytest.LogCaptureFixture, model_name: str
) -> None:
    with caplog.at_level("DEBUG"):
        c = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="k-good", max_retries=0)
        c.chat.completions.create(
            model=model_name,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"x-request-id": "keys-in-logs"},
        )
    assert "k-good" not in caplog.text
    rec = record_of(guarded, "keys-in-logs")
    assert rec.api_key_id and rec.api_key_id.startswith("key-") and "k-good" not in rec.api_key_id


@pytest.fixture(scope="module")
def narrow(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(tiny_settings(str(tiny_llama_dir), embedded={"max_num_seqs": 1, "max_waiting": 1}))
    yield live
    live.stop()


def test_overload_is_503_with_retry_after(
    narrow: LiveGateway, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = narrow.services.registry.embedded.client  # type: ignore[union-attr]
    real_step = worker.engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.005)  # the tiny model is fast; keep the first request running for a while
        return real_step()

    monkeypatch.setattr(worker.engine, "step", slow_step)
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=60) as h,
        h.stream("POST", f"{narrow.url}/v1/chat/completions", json=body) as first,
    ):
        lines = first.iter_lines()  # kept referenced: a collected iterator closes the stream
        assert next(lines).startswith("data: ")  # running: the only batch slot is taken
        second = threading.Thread(
            target=httpx.post,
            args=(f"{narrow.url}/v1/chat/completions",),
            kwargs={"json": {**body, "max_tokens": 2}, "timeout": 60},
        )
        second.start()  # waits for the slot: the queue is now full
        deadline = time.monotonic() + 10
        while worker.num_waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = httpx.post(f"{narrow.url}/v1/chat/completions", json={**body, "stream": False})
        assert third.status_code == 503
        assert int(third.headers["retry-after"]) >= 1
        assert _shape(third.json())["code"] == "overloaded"
    second.join(60)
    rec = records_settle(narrow, 3)
    assert [r.status for r in rec].count(503) == 1 and rec[-1].status == 200  # the waiting one was served


@pytest.mark.slow
def test_every_refused_request_leaves_exactly_one_record(guarded: LiveGateway, model_name: str) -> None:
    url = f"{guarded.url}/v1/chat/completions"
    # A key of its own: every request counts against its key's rate limit, refused ones included.
    key = {"authorization": "Bearer k-refusals"}
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 2}
    cases = {
        "rej-invalid": (
            httpx.post(url, json={**body, "temperature": 7}, headers={**key, "x-request-id": "rej-invalid"}),
            400,
        ),
        "rej-json": (
            httpx.post(
                url,
                content=b"{",
                headers={**key, "x-request-id": "rej-json", "content-type": "application/json"},
            ),
            400,
        ),
        "rej-key": (httpx.post(url, json=body, headers={"x-request-id": "rej-key"}), 401),
        "rej-model": (
            httpx.post(url, json={**body, "model": "zzz"}, headers={**key, "x-request-id": "rej-model"}),
            404,
        ),
        "rej-big": (
            httpx.post(
                url, json={**body, "pad": "x" * (5 * 2**20)}, headers={**key, "x-request-id": "rej-big"}
            ),
            413,
        ),
    }

    def chunked():  # type: ignore[no-untyped-def]
        yield b'{"model": "m", "pad": "'
        for _ in range(6):
            yield b"x" * 2**20
        yield b'"}'

    cases["rej-chunked"] = (
        httpx.post(
            url,
            content=chunked(),
            headers={**key, "x-request-id": "rej-chunked", "content-type": "application/json"},
        ),
        413,
    )
    records = guarded.services.recent.records
    assert wait_for(lambda: all(any(r.client_request_id == rid for r in records) for rid in cases), 10)
    for rid, (response, status) in cases.items():
        assert response.status_code == status, rid
        mine = [r for r in records if r.client_request_id == rid]
        assert len(mine) == 1, rid
        assert mine[0].status == status and mine[0].outcome == "error" and mine[0].endpoint == "chat"
    assert [r.model for r in records if r.client_request_id == "rej-invalid"] == [model_name]
