"""/v1/models, /healthz, /readyz and /metrics."""

from __future__ import annotations

import contextlib

import httpx
import openai

from tests.gateway.live import ADMIN_HEADERS, LiveGateway, readiness


def test_models(client: openai.OpenAI, model_name: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].object == "model" and models[0].owned_by == "specgate"
    assert client.models.retrieve(model_name).id == model_name


def test_health_and_readiness(gateway: LiveGateway) -> None:
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}  # anyone: ready or not
    body = readiness(gateway.url)  # the operator: what each check found
    assert body["status"] == "ready" and body["checks"]["embedded_model"]["state"] == "ready"
    assert body["checks"]["store"]["detail"] and "backends" in body
    wrong = httpx.get(f"{gateway.url}/readyz", headers={"authorization": "Bearer not-the-admin-key"})
    assert wrong.json() == {"status": "ready"}


def test_readiness_fails_when_a_check_fails(gateway: LiveGateway) -> None:
    async def store_down() -> tuple[bool, str]:
        return False, "connection refused"

    gateway.services.readiness["store"] = store_down
    try:
        r = httpx.get(f"{gateway.url}/readyz", headers=ADMIN_HEADERS)
        assert r.status_code == 503 and r.json()["checks"]["store"]["detail"] == "connection refused"
        assert httpx.get(f"{gateway.url}/readyz").json() == {"status": "not_ready"}
    finally:
        del gateway.services.readiness["store"]
    assert httpx.get(f"{gateway.url}/readyz").status_code == 200


def test_metrics(gateway: LiveGateway, client: openai.OpenAI, model_name: str) -> None:
    client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "abababababab"}],
        max_tokens=6,
        extra_body={"spec": {"method": "ngram", "controller": "static"}},
    )
    with contextlib.suppress(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    text = httpx.get(f"{gateway.url}/metrics").text
    assert (
        f'specgate_requests_total{{backend="embedded",endpoint="chat",model="{model_name}",outcome="ok",status="200"}}'
        in text
    )
    # A model name from a request body never becomes a label of its own.
    assert 'model="unknown",outcome="error",status="404"' in text and "missing" not in text
    for name in (
        "specgate_ttft_seconds_bucket",
        "specgate_tpot_seconds_bucket",
        "specgate_e2e_seconds_bucket",
        "specgate_gateway_overhead_seconds_bucket",
        "specgate_engine_queue_depth",
        "specgate_engine_batch_size",
        "specgate_engine_kv_usage",
        'specgate_backend_up{backend="embedded"} 1.0',
        f'specgate_spec_draft_tokens_total{{method="ngram",model="{model_name}"}}',
    ):
        assert name in text, name
