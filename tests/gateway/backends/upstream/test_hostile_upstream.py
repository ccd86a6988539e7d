"""A hostile or broken upstream gets a clean 502 / 503 / 504, and a failover while nothing reached the
client; the gateway, its metrics and its telemetry records stay whole."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from specgate.gateway.settings import ModelRoute
from tests.gateway.fake_upstream import HTTP, FakeUpstream, Reply, backend, running_gateway
from tests.gateway.live import LiveGateway, record_of, wait_for

pytestmark = pytest.mark.timeout(90)

MODEL = "m"
SSE = [("content-type", "text/event-stream")]
JSON_CT = [("content-type", "application/json")]
OK_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'

# name -> (the hostile reply, whether the request streams, the status it becomes on its own)
CASES: dict[str, tuple[Reply, bool, int]] = {
    "body over the limit": (Reply.raw(200, [b'{"pad":"' + b"x" * 200_000 + b'"}'], JSON_CT), False, 502),
    "html instead of json": (
        Reply.raw(200, b"<html>oops</html>", [("content-type", "text/html")]),
        False,
        502,
    ),
    "json that is not an object": (Reply.raw(200, b"[1, 2, 3]", JSON_CT), False, 502),
    "choices not a list": (Reply.raw(200, b'{"choices": "nope"}', JSON_CT), False, 502),
    "bytes that are not utf-8": (Reply.raw(200, b'{"choices": [], "x": "\xff\xfe"}', JSON_CT), False, 502),
    "negative usage": (
        Reply.raw(200, b'{"choices": [], "usage": {"prompt_tokens": -5, "completion_tokens": 3}}', JSON_CT),
        False,
        502,
    ),
    "huge usage": (
        Reply.raw(200, b'{"choices": [], "usage": {"completion_tokens": 1e300}}', JSON_CT),
        False,
        502,
    ),
    "nested too deep": (Reply.raw(200, b'{"a":' * 200 + b"1" + b"}" * 200, JSON_CT), False, 502),
    "stream line over the limit": (Reply.raw(200, [b"data: " + b"x" * 200_000], SSE), True, 502),
    "stream that is not utf-8": (Reply.raw(200, [b"data: \xff\xfe\n\n"], SSE), True, 502),
    "stream chunk not an object": (Reply.raw(200, [b"data: [1, 2]\n\n"], SSE), True, 502),
    "stream as html": (Reply.raw(200, b"<html></html>", [("content-type", "text/html")]), True, 502),
    "comments only, forever": (
        Reply.raw(200, [b": keep-alive\n\n"], SSE, every=0.05, forever=True),
        True,
        504,
    ),
    "gzip that does not decode": (
        Reply.raw(
            200, b"not gzip at all", [("content-type", "application/json"), ("content-encoding", "gzip")]
        ),
        False,
        502,
    ),
    "retry-after infinity": (Reply.error(503, retry_after="inf"), False, 503),
    "retry-after nan": (Reply.error(429, retry_after="nan"), True, 429),
    "its own 401": (Reply.error(401, "Incorrect API key provided: sk-upstr****"), False, 502),
    "its own 403": (Reply.error(403, "key sk-upstream-secret is not allowed"), True, 502),
}


@pytest.fixture(scope="module")
def hostile() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=(MODEL,), text="from the hostile one") as fake:
        yield fake


@pytest.fixture(scope="module")
def good() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=(MODEL,), text="from the good one") as fake:
        yield fake


def _knobs() -> dict:
    # Small limits so the cases are quick; no retries on the same backend (each case scripts one reply).
    return dict(
        read_timeout=1.0,
        max_retries=0,
        max_response_bytes=65536,
        max_event_bytes=65536,
        breaker_failures=1000,
    )


@pytest.fixture(scope="module")
def alone(hostile: FakeUpstream) -> Iterator[LiveGateway]:
    with running_gateway(backend("hostile", hostile, **_knobs())) as live:
        yield live


@pytest.fixture(scope="module")
def paired(hostile: FakeUpstream, good: FakeUpstream) -> Iterator[LiveGateway]:
    backends = [backend("hostile", hostile, **_knobs()), backend("good", good, **_knobs())]
    routes = {MODEL: ModelRoute(backends=["hostile", "good"])}
    with running_gateway(*backends, routes=routes) as live:
        yield live


def _post(live: LiveGateway, stream: bool, rid: str = "") -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    headers = {"x-request-id": rid} if rid else {}
    return HTTP.post(f"{live.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("case", list(CASES))
def test_alone_it_becomes_a_clean_error(alone: LiveGateway, hostile: FakeUpstream, case: str) -> None:
    reply, stream, status = CASES[case]
    hostile.reset()
    hostile.script(reply)
    rid = f"alone-{uuid.uuid4().hex[:8]}"
    r = _post(alone, stream, rid)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    assert "sk-upstr" not in r.text  # an upstream's words about its keys never reach our client
    if "retry-after" in case:
        assert 1 <= int(r.headers["retry-after"]) <= 3600
    rec = record_of(alone, rid)
    assert rec.status == status and rec.outcome == "error"
    assert HTTP.get(f"{alone.url}/metrics").status_code == 200


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2] != 429])
def test_with_a_second_backend_it_fails_over(
    paired: LiveGateway, hostile: FakeUpstream, good: FakeUpstream, case: str
) -> None:
    reply, stream, _ = CASES[case]
    hostile.reset()
    hostile.script(reply)
    rid = f"paired-{uuid.uuid4().hex[:8]}"
    r = _post(paired, stream, rid)
    assert r.status_code == 200, r.text
    text = r.text if stream else json.dumps(r.json())
    assert "good" in text and "hostile" not in text.split('"route"')[0]
    assert record_of(paired, rid).backend == "good"


def test_a_full_local_pool_is_not_the_backends_fault(hostile: FakeUpstream) -> None:
    """Our connection pool running dry must not open the backend's breaker."""
    import asyncio

    from specgate.gateway.backends.base import BackendCall
    from specgate.gateway.backends.upstream.backend import OpenAIBackend
    from specgate.gateway.backends.upstream.client import UpstreamClient
    from specgate.gateway.protocol.errors import GatewayError
    from specgate.gateway.protocol.schemas import ChatCompletionRequest

    async def run() -> tuple[int, int]:
        client = UpstreamClient(max_connections=1)
        b = OpenAIBackend(backend("hostile", hostile, connect_timeout=0.2, max_retries=0), client)
        req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}])  # type: ignore[list-item]

        def call() -> BackendCall:
            return BackendCall("r", "chat", MODEL, req.model_dump(exclude_unset=True), req, 0)

        hostile.reset()
        hostile.script(Reply.hang())
        holder = asyncio.create_task(b.complete(call()))  # takes the only connection and keeps it
        await asyncio.sleep(0.2)
        try:
            await b.complete(call())
        except GatewayError as err:
            status = err.status
        holder.cancel()
        await client.aclose()
        return status, b.breaker.failures

    status, failures = asyncio.run(run())
    hostile.stop()
    hostile.start()
    assert status == 503 and failures == 0


@pytest.mark.slow
def test_a_stream_that_never_ends_is_cut_at_its_total_deadline(hostile: FakeUpstream) -> None:
    """Data events well within the idle timeout, forever: the total deadline still ends it."""
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
    with running_gateway(
        backend("slow", hostile, read_timeout=5.0, total_timeout=2.0, max_retries=0)
    ) as live:
        hostile.reset()
        hostile.script(Reply.raw(200, [chunk], SSE, every=0.2, forever=True))
        started = time.monotonic()
        r = _post(live, stream=True)
        took = time.monotonic() - started
        assert r.status_code == 200 and took < 10  # it had started: the end is an error event
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "timeout" and "total timeout" in events[-1]["error"]["message"]
        # The record is settled once the response is over, just after the client read its end.
        records = live.services.recent.records
        assert wait_for(lambda: len(records) > 0 and records[-1].error_code == "timeout", 5)


def test_a_hostile_model_listing_cannot_poison_routes_readyz_or_metrics(hostile: FakeUpstream) -> None:
    weird = FakeUpstream(
        models=("ok-model", "\ud800", "x" * 1000, "bad\nname", *(f"m{i}" for i in range(2000)))
    )
    with weird, running_gateway(backend("weird", weird, models={}, health_interval=0.0)) as live:
        listed = live.services.registry.get("weird").model_ids()  # type: ignore[union-attr]
        assert "ok-model" in listed and len(listed) <= 1024
        assert all(m.isprintable() and len(m) <= 256 for m in listed)
        assert HTTP.get(f"{live.url}/readyz").status_code == 200
        assert HTTP.get(f"{live.url}/metrics").status_code == 200
