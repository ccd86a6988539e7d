"""POST /v1/embeddings and /v1/rerank: relayed to the model's external backends (scripted fakes,
tests/gateway/fake_upstream.py), with failover, the inference routes' key / rate / in-flight
checks, and exactly one telemetry row per request, refused or not."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.fake_upstream import (
    HTTP,
    FakeUpstream,
    Reply,
    backend,
    fake_embedding,
    metric_value,
    running_gateway,
)
from tests.gateway.live import LiveGateway, record_of, start_gateway, tiny_settings

pytestmark = pytest.mark.timeout(120)

KEY = "sk-embeddings-tests"
AUTH = {"authorization": f"Bearer {KEY}"}


def post(live: LiveGateway, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    rid = f"emb-{uuid.uuid4().hex}"
    return HTTP.post(f"{live.url}{path}", json=body, headers={**AUTH, "x-request-id": rid, **(headers or {})})


def rid_of(r: httpx.Response) -> str:
    return r.headers["x-request-id"]


def telemetry(tmp: Path) -> dict[str, Any]:
    return {"url": f"sqlite:///{tmp / 'telemetry.db'}", "auto_upgrade": True, "flush_interval": 0.02}


def rows(live: LiveGateway, client_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each client x-request-id's telemetry rows (the writer flushed first)."""
    store = live.services.store
    assert store is not None and store.writer.flush(20)
    engine = schema.make_engine(store.url)
    try:
        with engine.connect() as conn:
            found = conn.execute(sa.select(requests).where(requests.c.client_request_id.in_(client_ids)))
            out: dict[str, list[dict[str, Any]]] = {rid: [] for rid in client_ids}
            for row in found.mappings():
                out[row["client_request_id"]].append(dict(row))
    finally:
        engine.dispose()
    return out


@pytest.fixture(scope="module")
def a() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=("a-emb",)) as fake:
        yield fake


@pytest.fixture(scope="module")
def b() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=("b-emb",)) as fake:
        yield fake


@pytest.fixture(scope="module")
def live(
    tiny_llama_dir: Path, a: FakeUpstream, b: FakeUpstream, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveGateway]:
    """The embedded tiny model beside two external backends: `shared` on both (a first), `only-b`
    on b alone, under another name upstream."""
    settings = tiny_settings(
        str(tiny_llama_dir),
        api_keys=[KEY],
        telemetry=telemetry(tmp_path_factory.mktemp("embeddings")),
        log_requests=False,
        backends=[
            backend("a", a, models={"shared": "a-emb"}, breaker_failures=50),
            backend("b", b, models={"shared": "b-emb", "only-b": "b-emb"}, breaker_failures=50),
        ],
    )
    gateway = start_gateway(settings)
    yield gateway
    gateway.stop()


@pytest.fixture(autouse=True)
def _fresh(a: FakeUpstream, b: FakeUpstream) -> None:
    a.reset()
    b.reset()
    a.passthrough = b.passthrough = True


def test_embeddings_go_to_the_backends_of_the_model_and_come_back_as_sent(
    live: LiveGateway, a: FakeUpstream, b: FakeUpstream
) -> None:
    body = {"model": "only-b", "input": ["hello", "hi"], "dimensions": 4, "normalize": True}
    r = post(live, "/v1/embeddings", body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "only-b"  # the public name, not the backend's own
    assert [d["embedding"] for d in answer["data"]] == [fake_embedding("hello"), fake_embedding("hi")]
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert not a.posts("/v1/embeddings")
    (sent,) = b.posts("/v1/embeddings")
    # The backend's own name for the model; what the client sent, unknown (vendor) fields included.
    assert sent.body == {"model": "b-emb", "input": ["hello", "hi"], "dimensions": 4, "normalize": True}

    r = post(live, "/v1/embeddings", {"model": "shared", "input": [[1, 2, 3]]})
    assert r.status_code == 200, r.text
    assert len(a.posts("/v1/embeddings")) == 1  # the model's first backend
    assert r.json()["data"][0]["embedding"] == fake_embedding([1, 2, 3])


def test_a_failing_backend_fails_over_to_a_healthy_one(
    live: LiveGateway, a: FakeUpstream, b: FakeUpstream
) -> None:
    before = (
        metric_value(HTTP.get(f"{live.url}/metrics").text, "specgate_failovers_total", model="shared") or 0
    )
    a.script(*[Reply.error(503, "overloaded")] * 3)  # every attempt a makes (max_retries=2)
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "hello"})
    assert r.status_code == 200, r.text
    assert len(a.posts("/v1/embeddings")) == 3 and len(b.posts("/v1/embeddings")) == 1
    rec = record_of(live, rid_of(r))
    assert (rec.endpoint, rec.backend, rec.status, rec.attempts, rec.prompt_tokens) == (
        "embeddings",
        "b",
        200,
        4,
        5,
    )
    after = metric_value(HTTP.get(f"{live.url}/metrics").text, "specgate_failovers_total", model="shared")
    assert after == before + 1

    # A backend that does not serve the endpoint at all (a chat-only server: 404) is passed over too.
    a.passthrough = False
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "hello"})
    assert r.status_code == 200 and record_of(live, rid_of(r)).backend == "b"

    # Not retryable (the request is wrong): the client gets the backend's own 400, no failover.
    a.passthrough = True
    a.script(Reply.error(400, "input is too long", code="context_length_exceeded", param="input"))
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "hello"})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "input is too long",
        "type": "server_error",
        "param": "input",
        "code": "context_length_exceeded",
    }
    assert len(b.posts("/v1/embeddings")) == 2

    # Every backend down: an OpenAI-shaped 503 with Retry-After.
    a.script(*[Reply.error(503)] * 3)
    b.script(*[Reply.error(503)] * 3)
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "hello"})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "backends_unavailable"


def test_the_embedded_model_does_not_embed_and_says_so(live: LiveGateway, tiny_llama_dir: Path) -> None:
    r = post(live, "/v1/embeddings", {"model": tiny_llama_dir.name, "input": "hello"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "model_not_supported" and error["param"] == "model"
    assert "does not serve embeddings" in error["message"]
    r = post(live, "/v1/rerank", {"model": tiny_llama_dir.name, "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "reranking" in r.json()["error"]["message"]
    r = post(live, "/v1/embeddings", {"model": "nobody-serves-this", "input": "hello"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": "shared"}, "input"),
        ({"model": "shared", "input": ""}, "input"),
        ({"model": "shared", "input": []}, "input"),
        ({"model": "shared", "input": [-1]}, "input"),
        ({"model": "shared", "input": ["x"] * 2049}, "input"),
        ({"model": "shared", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "shared", "input": "x", "dimensions": 0}, "dimensions"),
        ({"model": "shared", "input": "x", "user": "u" * 257}, "user"),
    ],
)
def test_invalid_bodies_are_refused_at_the_edge(
    live: LiveGateway, a: FakeUpstream, body: dict[str, Any], param: str
) -> None:
    r = post(live, "/v1/embeddings", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not a.posts()


def test_unknown_fields_are_bounded(live: LiveGateway, a: FakeUpstream) -> None:
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "x", "vendor": "v" * 20_000})
    assert r.status_code == 400 and "vendor" in r.json()["error"]["message"]
    many = {f"f{i}": i for i in range(33)}
    r = post(live, "/v1/embeddings", {"model": "shared", "input": "x", **many})
    assert r.status_code == 400
    assert not a.posts()


def test_the_openai_sdk_embeds_through_the_gateway(live: LiveGateway, a: FakeUpstream) -> None:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=20)
    # The SDK asks for base64 unless told otherwise, and decodes it: the fake encodes what it was asked.
    got = client.embeddings.create(model="shared", input=["abc", "de"])
    assert [d.embedding for d in got.data] == [fake_embedding("abc"), fake_embedding("de")]
    assert got.usage.prompt_tokens == 5 and got.model == "shared"
    assert a.posts("/v1/embeddings")[-1].body["encoding_format"] == "base64"
    floats = client.embeddings.create(model="shared", input="abc", encoding_format="float")
    assert floats.data[0].embedding == fake_embedding("abc")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).embeddings.create(
            model="shared", input="x"
        )


def test_rerank_is_relayed_on_both_paths(live: LiveGateway, b: FakeUpstream) -> None:
    for path in ("/v1/rerank", "/rerank"):
        r = post(live, path, {"model": "only-b", "query": "q", "documents": ["a", "b", "c"], "top_n": 2})
        assert r.status_code == 200, r.text
        assert [x["index"] for x in r.json()["results"]] == [0, 1, 2]
        assert record_of(live, rid_of(r)).endpoint == "rerank"
    assert [p.path for p in b.posts()] == ["/v1/rerank", "/v1/rerank"]
    assert b.posts()[0].body == {"model": "b-emb", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}


def test_one_row_per_request_refused_or_not(live: LiveGateway, a: FakeUpstream, tiny_llama_dir: Path) -> None:
    sent = {
        "ok": post(live, "/v1/embeddings", {"model": "shared", "input": ["four", "five5"]}),
        "no_key": post(live, "/v1/embeddings", {"model": "shared", "input": "x"}, {"authorization": ""}),
        "bad_key": post(
            live, "/v1/embeddings", {"model": "shared", "input": "x"}, {"authorization": "Bearer no"}
        ),
        "invalid": post(live, "/v1/embeddings", {"model": "shared", "input": []}),
        "not_json": HTTP.post(
            f"{live.url}/v1/embeddings",
            content=b"{",
            headers={**AUTH, "x-request-id": f"emb-{uuid.uuid4().hex}"},
        ),
        "unknown_model": post(live, "/v1/embeddings", {"model": "nope", "input": "x"}),
        "embedded": post(live, "/v1/embeddings", {"model": tiny_llama_dir.name, "input": "x"}),
        "rerank": post(live, "/v1/rerank", {"model": "shared", "query": "q", "documents": ["d"]}),
    }
    statuses = {name: r.status_code for name, r in sent.items()}
    assert statuses == {
        "ok": 200,
        "no_key": 401,
        "bad_key": 401,
        "invalid": 400,
        "not_json": 400,
        "unknown_model": 404,
        "embedded": 400,
        "rerank": 200,
    }
    by_id = rows(live, [rid_of(r) for r in sent.values()])
    assert {name: len(by_id[rid_of(r)]) for name, r in sent.items()} == dict.fromkeys(sent, 1)
    row = {name: by_id[rid_of(r)][0] for name, r in sent.items()}
    assert row["ok"]["endpoint"] == "embeddings" and row["rerank"]["endpoint"] == "rerank"
    assert (row["ok"]["backend"], row["ok"]["outcome"], row["ok"]["prompt_tokens"]) == ("a", "ok", 9)
    assert row["ok"]["api_key_id"] and row["ok"]["model"] == "shared"
    assert (row["no_key"]["status"], row["no_key"]["error_code"], row["no_key"]["api_key_id"]) == (
        401,
        "invalid_api_key",
        None,
    )
    assert row["invalid"]["error_code"] == "invalid_value" and row["invalid"]["api_key_id"]
    assert row["not_json"]["error_code"] == "invalid_json"
    assert row["unknown_model"]["error_code"] == "model_not_found" and row["unknown_model"]["model"] == "nope"
    assert row["embedded"]["error_code"] == "model_not_supported"
    assert all(r["outcome"] == "error" for name, r in row.items() if name not in ("ok", "rerank"))


def test_the_rate_limit_applies(a: FakeUpstream) -> None:
    with running_gateway(backend("a", a, models={"emb": "a-emb"}), api_keys=[KEY], rate_limit_rpm=12) as gw:
        # A burst of rpm / 6: two requests, then the limit.
        statuses = [post(gw, "/v1/embeddings", {"model": "emb", "input": "x"}) for _ in range(3)]
        assert [r.status_code for r in statuses] == [200, 200, 429]
        assert statuses[2].headers["retry-after"]
        assert statuses[2].json()["error"]["code"] == "rate_limit_exceeded"
        # The same bucket as the inference routes: chat is limited too now.
        chat = {"model": "emb", "messages": [{"role": "user", "content": "x"}]}
        assert post(gw, "/v1/chat/completions", chat).status_code == 429
        rec = record_of(gw, rid_of(statuses[2]))
        assert (rec.endpoint, rec.status, rec.error_code) == ("embeddings", 429, "rate_limit_exceeded")
        assert rec.api_key_id is not None  # counted against its key


@pytest.mark.slow
def test_the_in_flight_cap_applies(a: FakeUpstream) -> None:
    # The hung first request holds its key's one slot until the read timeout: long enough that a
    # stalled CI machine still sends the second request inside it.
    knobs = {"read_timeout": 4.0, "max_retries": 0}
    with running_gateway(
        backend("a", a, models={"emb": "a-emb"}, **knobs), api_keys=[KEY], max_in_flight_per_key=1
    ) as gw:
        a.script(Reply.hang())
        first: list[httpx.Response] = []
        slow = threading.Thread(
            target=lambda: first.append(post(gw, "/v1/embeddings", {"model": "emb", "input": "x"}))
        )
        slow.start()
        deadline = time.monotonic() + 5
        while not a.posts("/v1/embeddings") and time.monotonic() < deadline:
            time.sleep(0.01)
        second = post(gw, "/v1/embeddings", {"model": "emb", "input": "y"})
        slow.join(10)
        assert second.status_code == 429, second.text
        assert "at once" in second.json()["error"]["message"]
        assert first and first[0].status_code in (503, 504)  # the hung backend timed out
        # Its slot went back: the next request is served.
        assert post(gw, "/v1/embeddings", {"model": "emb", "input": "z"}).status_code == 200


def test_the_body_size_limit_applies(a: FakeUpstream) -> None:
    with running_gateway(backend("a", a, models={"emb": "a-emb"}), max_body_bytes=2048) as gw:
        r = post(gw, "/v1/embeddings", {"model": "emb", "input": "x" * 4096})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        rec = record_of(gw, rid_of(r))
        assert (rec.endpoint, rec.status, rec.error_code) == ("embeddings", 413, "request_too_large")
        assert not a.posts("/v1/embeddings")


def test_the_openapi_document_lists_the_pass_through_routes(live: LiveGateway) -> None:
    spec = HTTP.get(f"{live.url}/openapi.json").json()
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/tokenize", "/detokenize"):
        assert "post" in spec["paths"][path], path
    schemas = spec["components"]["schemas"]
    assert schemas["EmbeddingRequest"]["properties"]["input"]
    assert {"EmbeddingRequest", "RerankRequest", "TokenizeRequest", "DetokenizeRequest"} <= set(schemas)


def test_a_client_cache_salt_never_reaches_the_backend_as_sent(live: LiveGateway, b: FakeUpstream) -> None:
    for _ in range(2):
        assert (
            post(live, "/v1/embeddings", {"model": "only-b", "input": "x", "cache_salt": "mine"}).status_code
            == 200
        )
    first, second = (p.body["cache_salt"] for p in b.posts("/v1/embeddings"))
    assert first != "mine" and first == second  # the tenant's own salt, the same for the same key
