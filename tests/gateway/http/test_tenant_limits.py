"""No tenant can starve another: caps on requests in flight and streams open per key (per address in
open mode), configurable per key, and an engine whose batch slots and queue are shared fairly. A hog
tenant beside a victim tenant, against a live gateway."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.limits.limiters import ConcurrencyLimiter
from specgate.gateway.settings import Settings
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for

HOG, VICTIM, SMALL = "sk-hog-0001", "sk-victim-0001", "sk-small-0001"


@pytest.fixture(scope="module")
def tenants(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(
            str(tiny_llama_dir),
            api_keys=[HOG, VICTIM, {"key": SMALL, "max_in_flight": 2, "max_streams": 1}],
            max_in_flight_per_key=12,
            max_streams_per_key=12,
            log_requests=False,
            embedded={"max_num_seqs": 4, "max_waiting": 8},
        )
    )
    yield live
    live.stop()


def _body(live: LiveGateway, tokens: int, stream: bool = False) -> dict[str, Any]:
    model = live.services.registry.embedded.served_name  # type: ignore[union-attr]
    return {
        "model": model,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


def _post(live: LiveGateway, key: str, tokens: int, stream: bool = False) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        f"{live.url}/v1/chat/completions", json=_body(live, tokens, stream), headers=headers, timeout=120
    )


def _hog(live: LiveGateway, n: int, tokens: int) -> tuple[list[threading.Thread], list[int]]:
    statuses: list[int] = []

    def one() -> None:
        statuses.append(_post(live, HOG, tokens).status_code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, statuses


@pytest.mark.slow
def test_a_key_over_its_cap_gets_429_with_retry_after_and_others_do_not(tenants: LiveGateway) -> None:
    threads, statuses = _hog(tenants, 16, 120)  # more than its 12 in flight
    worker = tenants.services.registry.embedded.client  # type: ignore[union-attr]
    assert wait_for(lambda: worker is not None and worker.load.num_running == 4, 30)
    assert wait_for(lambda: statuses.count(429) >= 4, 30)
    refused = _post(tenants, HOG, 2)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    # The victim is another key: its own cap, and a batch slot as soon as one is fair.
    start = time.monotonic()
    r = _post(tenants, VICTIM, 2)
    assert r.status_code == 200
    assert time.monotonic() - start < 10
    for t in threads:
        t.join(120)
    assert statuses.count(200) == 12 and statuses.count(429) == 4
    # Every slot came back: the key may send again.
    assert tenants.services.in_flight.count(f"req:{tenants.services.key_ids.of(HOG)}") == 0
    assert _post(tenants, HOG, 2).status_code == 200


@pytest.mark.slow
def test_the_victims_short_request_overtakes_the_hogs_queue(tenants: LiveGateway) -> None:
    threads, statuses = _hog(tenants, 12, 150)  # every batch slot and the whole queue
    worker = tenants.services.registry.embedded.client  # type: ignore[union-attr]
    assert wait_for(lambda: worker is not None and worker.num_waiting >= 8, 30)
    start = time.monotonic()
    r = _post(tenants, VICTIM, 2)  # the queue is full, but not with the victim's requests
    took = time.monotonic() - start
    hog_done = statuses.count(200)
    assert r.status_code == 200, r.text
    # Served ahead of the hog's queued requests (a hog request was preempted for it), not after.
    assert hog_done <= 4 and took < 10
    assert r.json()["usage"]["completion_tokens"] == 2
    for t in threads:
        t.join(120)
    assert statuses.count(200) == 12  # the hog lost nothing but its turn


def test_a_key_with_limits_of_its_own(tenants: LiveGateway) -> None:
    # The first stream is read here, a chunk at a time, so it is still open (hundreds of decode
    # steps from its end) when the second one is sent: a short stream in a thread could end first.
    headers = {"authorization": f"Bearer {SMALL}"}
    url = f"{tenants.url}/v1/chat/completions"
    with httpx.stream(
        "POST", url, json=_body(tenants, 400, stream=True), headers=headers, timeout=120
    ) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert any(line.startswith("data: ") for line in lines)  # the stream has begun
        assert tenants.services.in_flight.count(f"stream:{tenants.services.key_ids.of(SMALL)}") == 1
        second_stream = _post(tenants, SMALL, 2, stream=True)
        assert second_stream.status_code == 429  # one stream at a time for this key
        assert "streams" in second_stream.json()["error"]["message"]
        assert _post(tenants, SMALL, 2).status_code == 200  # a second request, not a stream, still fits
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"  # the first stream lost nothing
    key = f"stream:{tenants.services.key_ids.of(SMALL)}"
    assert wait_for(lambda: tenants.services.in_flight.count(key) == 0, 10)  # its slot came back
    assert _post(tenants, SMALL, 2, stream=True).status_code == 200


def test_open_mode_caps_per_client_address(tiny_llama_dir: Path) -> None:
    live = start_gateway(tiny_settings(str(tiny_llama_dir), max_in_flight_per_key=1, log_requests=False))
    try:
        url, body = f"{live.url}/v1/chat/completions", _body(live, 400, stream=True)
        headers = {"authorization": "Bearer anything"}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as first:  # held open here
            lines = first.iter_lines()
            assert any(line.startswith("data: ") for line in lines)
            assert live.services.in_flight.count("req:addr:127.0.0.1") == 1
            assert _post(live, "another-made-up-key", 2).status_code == 429  # a new bearer buys nothing
            rest = [line for line in lines if line]
        assert first.status_code == 200 and rest[-1] == "data: [DONE]"
    finally:
        live.stop()


def test_the_default_limits_are_out_of_a_single_users_way() -> None:
    s = Settings()
    assert s.max_in_flight_per_key >= s.embedded.max_num_seqs + s.embedded.max_waiting // 2
    assert s.max_streams_per_key >= s.embedded.max_num_seqs


def test_in_process_counts_go_back_to_nothing() -> None:
    c = ConcurrencyLimiter()
    assert c.acquire("a", 2) and c.acquire("a", 2) and not c.acquire("a", 2)
    assert c.acquire("b", 0)  # 0: no cap, still counted
    c.release("a")
    assert c.count("a") == 1 and c.acquire("a", 2)
    for key in ("a", "a", "b"):
        c.release(key)
    assert c.counts == {}


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.slow
def test_a_client_at_its_cap_is_never_refused_for_answers_it_already_has(stream: bool) -> None:
    """Clients that each wait for their answer before sending the next hold one slot each: as many
    clients as the cap allows, back to back, are never refused. A slot is free once the client has
    the whole answer (the stream's end), not when the server gets round to its bookkeeping."""
    import asyncio

    from tests.gateway.fake_upstream import FakeUpstream, backend, running_gateway

    clients, cap, each = 24, 24, 15
    caps = {"max_streams_per_key": cap} if stream else {"max_in_flight_per_key": cap}
    with FakeUpstream(models=("m",), text="hi") as fake, running_gateway(backend("up", fake), **caps) as live:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        statuses: list[int] = []

        async def client() -> None:
            async with httpx.AsyncClient(base_url=live.url, timeout=30) as c:
                for _ in range(each):
                    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        await r.aread()
                        statuses.append(r.status_code)

        async def run() -> None:
            await asyncio.gather(*(client() for _ in range(clients)))

        asyncio.run(run())
    assert statuses.count(200) == clients * each, sorted(set(statuses))


@pytest.mark.slow
def test_a_request_refused_by_a_limit_is_still_counted_against_its_key() -> None:
    from tests.gateway.fake_upstream import FakeUpstream, backend, running_gateway
    from tests.gateway.live import record_of

    with (
        FakeUpstream(models=("m",), text="hi") as fake,
        running_gateway(backend("up", fake), api_keys=[VICTIM], rate_limit_rpm=1) as live,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        statuses = []
        for i in range(2):
            headers = {"authorization": f"Bearer {VICTIM}", "x-request-id": f"limited-{i}"}
            statuses.append(
                httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers).status_code
            )
        assert statuses == [200, 429]
        first, refused = record_of(live, "limited-0"), record_of(live, "limited-1")
        assert first is not None and refused is not None and first.api_key_id is not None
        assert refused.api_key_id == first.api_key_id and refused.status == 429
