"""An external backend's load as the router reads it: its own /metrics where they can be believed,
else this gateway's requests in flight there (summed over worker processes).

The upstream is the scripted fake (tests/gateway/fake_upstream.py) serving GET /metrics as a test
sets it. Most tests drive one `OpenAIBackend` directly (`scrape()` is what its health loop calls
every interval); the last ones run a gateway whose health loop scrapes, and read /admin/backends.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from specgate.gateway.backends.base import BackendCall
from specgate.gateway.backends.upstream.backend import STALE_INTERVALS, OpenAIBackend
from specgate.gateway.backends.upstream.client import UpstreamClient
from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from specgate.gateway.settings import Settings
from tests.gateway.fake_upstream import HTTP, FakeUpstream, Reply, backend, running_gateway
from tests.gateway.live import ADMIN_HEADERS, LiveGateway, wait_for

pytestmark = pytest.mark.timeout(60)

FIXTURES = Path(__file__).parent / "metrics_fixtures"
T = TypeVar("T")


@pytest.fixture(scope="module")
def shared_fake() -> Iterator[FakeUpstream]:
    with FakeUpstream() as upstream:
        yield upstream


@pytest.fixture
def fake(shared_fake: FakeUpstream) -> FakeUpstream:
    shared_fake.reset()  # no script, /metrics back to 404
    shared_fake.scrapes = 0
    return shared_fake


def vllm(
    running: str | float = 2,
    waiting: str | float = 1,
    kv: str | float = 0.25,
    drafts: float | None = None,
    draft_tokens: float | None = None,
    accepted: float | None = None,
) -> str:
    """A vLLM /metrics text (the load gauges, and speculation counters where given)."""
    labels = '{model_name="m",engine="0"}'
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{labels} {running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{labels} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{labels} {kv}",
    ]
    for name, value in (
        ("num_drafts", drafts),
        ("num_draft_tokens", draft_tokens),
        ("num_accepted_tokens", accepted),
    ):
        if value is not None:
            lines += [
                f"# TYPE vllm:spec_decode_{name}_total counter",
                f"vllm:spec_decode_{name}_total{labels} {value}",
            ]
    return "\n".join(lines) + "\n"


def run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(make())


def new_backend(fake: FakeUpstream, **knobs: Any) -> OpenAIBackend:
    return OpenAIBackend(backend("up", fake, **knobs), UpstreamClient(max_connections=8))


async def scrape_all(b: OpenAIBackend, fake: FakeUpstream, texts: list[str | None]) -> list[bool]:
    """Scrape once per text (None: /metrics answers 404); the results."""
    out = []
    try:
        for text in texts:
            fake.metrics_text = text
            out.append(await b.scrape())
    finally:
        await b.client.aclose()
    return out


def scraped(fake: FakeUpstream, *texts: str | None, **knobs: Any) -> tuple[OpenAIBackend, list[bool]]:
    b = new_backend(fake, **knobs)
    return b, run(lambda: scrape_all(b, fake, list(texts)))


# ---- what a good scrape gives ----------------------------------------------------------------------


def test_vllm_metrics_are_the_backends_load(fake: FakeUpstream) -> None:
    b, ok = scraped(fake, (FIXTURES / "vllm_v1.txt").read_text())
    assert ok == [True] and fake.scrapes == 1
    load = b.load()
    # Two data-parallel engines: counts add up, KV usage is the fuller engine's.
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (21, 3, 0.62)
    assert load.batch == 24 and load.in_flight == 0 and load.scraped
    assert load.features()["load_running"] == 21.0 and load.features()["load_queue"] == 3.0
    m = b.status()["metrics"]
    assert m["load_source"] == "vllm" and m["error"] is None and m["enabled"] is True
    assert (m["running"], m["waiting"], m["kv_usage"]) == (21, 3, 0.62)
    assert m["url"] == f"{fake.url}/metrics"  # base_url without /v1, plus /metrics
    assert m["age_s"] is not None and 0.0 <= m["age_s"] < 5.0


def test_an_explicit_metrics_url_is_the_one_scraped(fake: FakeUpstream) -> None:
    b, ok = scraped(fake, vllm(), metrics_url=f"{fake.url}/elsewhere/metrics/")
    assert b.settings.metrics_endpoint == f"{fake.url}/elsewhere/metrics"  # trailing slash dropped
    assert ok == [False] and fake.scrapes == 0  # the fake serves only /metrics: a 404 there
    assert b.status()["metrics"]["error"] == "answered 404"


# ---- what cannot be believed: the gateway's own count ------------------------------------------------

HOSTILE_TEXTS = {
    "nan": (vllm(running="NaN"), "vllm:num_requests_running is NaN"),
    "negative": (vllm(waiting=-1), "vllm:num_requests_waiting is negative"),
    "infinite": (vllm(running="+Inf"), "not finite"),
    "kv over one": (vllm(kv=1.5), "outside [0, 1]"),
    "garbage": ("<html><body>Welcome to nginx!</body></html>\n", "malformed sample"),
    "no known server": ("some_other_metric 1\n", "no known load metrics"),
    "accepted over drafted": (vllm(drafts=10, draft_tokens=30, accepted=31), "exceeds"),
    "not found": (None, "answered 404"),
}


@pytest.mark.parametrize("case", list(HOSTILE_TEXTS))
def test_hostile_text_leaves_the_router_on_the_gateways_count(fake: FakeUpstream, case: str) -> None:
    text, why = HOSTILE_TEXTS[case]
    b, ok = scraped(fake, vllm(running=9, waiting=4), text, vllm(running=1, waiting=0))
    assert ok == [True, False, True]
    # Between the two good scrapes the earlier good snapshot was not used either.
    b2, ok2 = scraped(fake, vllm(running=9, waiting=4), text)
    assert ok2 == [True, False]
    load = b2.load()
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (None, None, None)
    assert load.batch == load.in_flight == 0 and not load.scraped
    m = b2.status()["metrics"]
    assert m["load_source"] == "gateway" and m["running"] is None
    assert m["error"] is not None and why in m["error"], m["error"]
    # And a good scrape after it is believed again.
    assert b.status()["metrics"]["error"] is None and b.load().num_running == 1


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (Reply.error(500), "answered 500"),
        (Reply.hang(), "TransportError"),
        (Reply.drop(), ""),
        (Reply.raw(chunks=[b"#" * 65536], forever=True), "over 4194304 bytes"),
        (Reply.raw(chunks=[b"\xff\xfe\x00 not utf-8 \x80\n"]), "malformed sample"),
    ],
    ids=["500", "hang", "drop", "endless", "binary"],
)
def test_a_failing_metrics_endpoint_is_reported_not_believed(
    fake: FakeUpstream, reply: Reply, why: str
) -> None:
    async def go(b: OpenAIBackend) -> tuple[bool, bool, float]:
        try:
            fake.metrics_text = vllm(running=5)
            first = await b.scrape()
            fake.metrics_reply = reply
            t0 = time.monotonic()
            second = await b.scrape()
            return first, second, time.monotonic() - t0
        finally:
            fake.metrics_reply = None  # release nothing here: a hung answer ends when the fake resets
            await b.client.aclose()

    b = new_backend(fake, read_timeout=0.3)
    first, second, took = run(lambda: go(b))
    assert (first, second) == (True, False)
    assert took < 3.0  # a hang costs at most the read timeout (or the scrape's own bound), never more
    m = b.status()["metrics"]
    assert m["load_source"] == "gateway" and m["error"] and why in m["error"], m["error"]
    assert b.load().num_running is None and b.load().batch == 0


@pytest.mark.slow
def test_a_hang_is_cut_by_the_scrapes_own_bound(fake: FakeUpstream) -> None:
    """With a read timeout longer than a health interval (the defaults: 60 s against 5 s), the
    scrape gives up after connect_timeout + max(health_interval, 1) seconds: a health loop is never
    held up for a whole read timeout."""

    async def go(b: OpenAIBackend) -> tuple[bool, float]:
        try:
            fake.metrics_reply = Reply.hang()
            t0 = time.monotonic()
            return await b.scrape(), time.monotonic() - t0
        finally:
            fake.metrics_reply = None
            await b.client.aclose()

    b = new_backend(fake, connect_timeout=0.2, read_timeout=60.0, health_interval=0.5)
    ok, took = run(lambda: go(b))
    assert ok is False and 1.0 <= took < 2.5  # 0.2 + max(0.5, 1.0)
    assert b.status()["metrics"]["error"] == "TimeoutError"
    assert b.load().num_running is None


def test_a_hung_metrics_endpoint_is_reported_as_a_timeout(fake: FakeUpstream) -> None:
    async def go(b: OpenAIBackend) -> bool:
        try:
            fake.metrics_reply = Reply.hang()
            return await b.scrape()
        finally:
            fake.metrics_reply = None
            await b.client.aclose()

    b = new_backend(fake, read_timeout=0.3)
    assert run(lambda: go(b)) is False
    error = b.status()["metrics"]["error"]
    assert error is not None and ("timed out" in error.lower() or "within" in error or "Timeout" in error)


def test_a_scrape_older_than_three_health_intervals_is_not_used(fake: FakeUpstream) -> None:
    interval = 2.0
    b, ok = scraped(fake, vllm(running=7, waiting=0), health_interval=interval)
    assert ok == [True] and STALE_INTERVALS == 3.0
    b.scraped_at = time.monotonic() - 2.9 * interval
    assert b.load().num_running == 7 and b.status()["metrics"]["load_source"] == "vllm"
    b.scraped_at = time.monotonic() - 3.1 * interval
    assert b.fresh_scrape() is None
    assert b.load().num_running is None and b.load().batch == 0
    m = b.status()["metrics"]
    assert m["load_source"] == "gateway" and m["running"] is None and m["age_s"] >= 6.0
    # With no health loop (interval 0) the horizon is three seconds.
    b0, _ = scraped(fake, vllm(running=7, waiting=0), health_interval=0.0)
    b0.scraped_at = time.monotonic() - 2.5
    assert b0.load().num_running == 7
    b0.scraped_at = time.monotonic() - 3.5
    assert b0.load().num_running is None


# ---- speculation: discovered or declared ------------------------------------------------------------


def test_auto_speculation_turns_on_once_the_counters_count_drafts(fake: FakeUpstream) -> None:
    b, ok = scraped(fake, vllm(), vllm(drafts=0, draft_tokens=0, accepted=0))
    assert ok == [True, True] and b.speculation is None and not b.load().speculative
    assert b.status()["speculation"] is None
    b2, ok2 = scraped(
        fake, vllm(drafts=0, draft_tokens=0, accepted=0), vllm(drafts=4, draft_tokens=12, accepted=6)
    )
    assert ok2 == [True, True]
    assert b2.speculation == "on" and b2.load().speculative and b2.status()["speculation"] == "on"


@pytest.mark.parametrize(
    ("declared", "without_drafts", "with_drafts"),
    [
        ("auto", None, "on"),
        ("off", None, None),
        ("on", "on", "on"),
        ("ngram", "ngram", "ngram"),
        ("suffix", "suffix", "suffix"),
        ("eagle", "eagle", "eagle"),
        ("draft_model", "draft_model", "draft_model"),
    ],
)
def test_a_declared_speculation_wins_over_the_metrics(
    fake: FakeUpstream, declared: str, without_drafts: str | None, with_drafts: str | None
) -> None:
    quiet, _ = scraped(fake, vllm(), speculative=declared)
    assert quiet.speculation == without_drafts
    drafting, _ = scraped(fake, vllm(drafts=4, draft_tokens=12, accepted=6), speculative=declared)
    assert drafting.speculation == with_drafts
    assert drafting.load().speculative is (with_drafts is not None)


def test_acceptance_length_comes_from_counter_deltas(fake: FakeUpstream) -> None:
    b, ok = scraped(
        fake,
        vllm(drafts=100, draft_tokens=300, accepted=150),  # a baseline only: no delta yet
        vllm(drafts=200, draft_tokens=600, accepted=330),  # 100 drafts, 180 accepted: 1 + 1.8
    )
    assert ok == [True, True]
    assert b.acceptance_length == 2.8 and b.load().acceptance_length == 2.8
    assert b.status()["metrics"]["acceptance_length"] == 2.8

    async def more() -> None:
        try:
            for text, want in (
                (vllm(drafts=200, draft_tokens=600, accepted=330), 2.8),  # no new drafts: unchanged
                (vllm(drafts=10, draft_tokens=30, accepted=20), 2.8),  # counters reset (a restart)
                (vllm(drafts=20, draft_tokens=60, accepted=25), 1.5),  # 10 drafts, 5 accepted
                (vllm(), 1.5),  # counters gone: the last value stands, the baseline goes
                (vllm(drafts=30, draft_tokens=90, accepted=40), 1.5),  # a new baseline, no delta
            ):
                fake.metrics_text = text
                assert await b.scrape()
                assert b.acceptance_length == want, text
        finally:
            await b.client.aclose()

    b.client = UpstreamClient(max_connections=8)
    run(more)
    first, _ = scraped(fake, vllm(drafts=100, draft_tokens=300, accepted=150))
    assert first.acceptance_length is None and first.speculation == "on"


# ---- in flight: this process, or every worker's -------------------------------------------------------


def call(model: str = "fake-model") -> BackendCall:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    request = ChatCompletionRequest.model_validate(body)
    return BackendCall(uuid.uuid4().hex, "chat", model, body, request, int(time.time()))


async def hold(backends: list[OpenAIBackend], fake: FakeUpstream, n: int) -> list[tuple[int, int]]:
    """`n` hung requests through each backend in turn; every backend's in-flight count while all
    are held, and after they are cancelled."""
    fake.script(*(Reply.hang() for _ in range(n * len(backends))))
    tasks = [asyncio.create_task(b.complete(call())) for b in backends for _ in range(n)]
    deadline = time.monotonic() + 10
    while len(fake.posts()) < len(tasks):
        assert time.monotonic() < deadline, "the requests never reached the upstream"
        await asyncio.sleep(0.01)
    held = [(b.in_flight, b.load().batch) for b in backends]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    after = [(b.in_flight, b.load().batch) for b in backends]
    for b in backends:
        await b.client.aclose()
    return held + after


def test_in_flight_is_this_processs_count_without_shared_counters(fake: FakeUpstream) -> None:
    a, b = new_backend(fake), new_backend(fake)  # same name, no shared counts: each its own
    counts = run(lambda: hold([a, b], fake, 2))
    assert counts == [(2, 2), (2, 2), (0, 0), (0, 0)]


def test_in_flight_is_every_workers_sum_with_shared_counters(fake: FakeUpstream) -> None:
    """Two attachments of one shared-memory segment, as two worker processes hold them: each
    worker's backend `up` counts the requests of both."""
    handle = SharedLimits.create(Settings())
    second = SharedLimits(
        handle.name,
        handle.lock,
        handle.secret,
        handle.tables,
        handle.rate_limit_rpm,
        handle.refused_rpm,
        handle.max_failed_signins,
        handle.signin_lockout,
    )  # what a spawned worker unpickles: attached by name, a mapping of its own
    try:
        workers = 2
        c0 = handle.attach().in_flight(0, workers)
        c1 = second.attach().in_flight(1, workers)
        assert handle.attach() is not second.attach()
        c0.bump(0)
        c1.bump(1)
        settings = backend("up", fake)
        w0 = OpenAIBackend(settings, UpstreamClient(max_connections=8), c0)
        w1 = OpenAIBackend(settings, UpstreamClient(max_connections=8), c1)
        counts = run(lambda: hold([w0, w1], fake, 2))
        assert counts == [(4, 4), (4, 4), (0, 0), (0, 0)]
        # The backend's key does not collide with a tenant's in-flight count in the same table.
        assert c0.count("up") == 0
        # A failed call leaves the count where it was.
        fake.script(Reply.error(400))

        async def failing() -> None:
            try:
                with pytest.raises(GatewayError):
                    await w0.complete(call())
            finally:
                await w0.client.aclose()

        w0.client = UpstreamClient(max_connections=8)
        run(failing)
        assert w0.in_flight == w1.in_flight == 0
    finally:
        second.close()  # a worker's: drops its mapping only
        handle.close()


# ---- through a gateway: its health loop scrapes, /admin/backends says what it uses ---------------------


def admin_backends(live: LiveGateway) -> dict[str, Any]:
    r = HTTP.get(f"{live.url}/admin/backends", headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def entry(live: LiveGateway, name: str) -> dict[str, Any]:
    return next(b for b in admin_backends(live)["backends"] if b["name"] == name)


@pytest.mark.slow
def test_the_health_loop_scrapes_and_admin_backends_shows_the_source(fake: FakeUpstream) -> None:
    fake.metrics_text = vllm(running=6, waiting=2, kv=0.5, drafts=10, draft_tokens=30, accepted=20)
    loud = backend("loud", fake, health_interval=0.1)
    quiet = backend("quiet", fake, health_interval=0.1, scrape_metrics=False, metrics_url=f"{fake.url}/q")
    with running_gateway(loud, quiet) as live:
        assert wait_for(lambda: entry(live, "loud")["metrics"]["load_source"] == "vllm", 10)
        up = entry(live, "loud")
        assert up["metrics"]["error"] is None and up["speculation"] == "on"
        assert (up["metrics"]["running"], up["metrics"]["waiting"], up["metrics"]["kv_usage"]) == (6, 2, 0.5)
        policy = up["policy_load"]
        assert (policy["running"], policy["waiting"], policy["batch"]) == (6, 2, 8)
        assert policy["speculative"] is True and policy["features"]["load_running"] == 6.0
        # The other backend is never scraped: its load is the gateway's own count.
        q = entry(live, "quiet")
        assert q["metrics"]["enabled"] is False and q["metrics"]["load_source"] == "gateway"
        assert q["metrics"]["error"] is None and q["policy_load"]["running"] is None
        assert q["speculation"] is None and q["policy_load"]["batch"] == 0
        assert admin_backends(live)["groups"] == []

        # The backend starts lying: within an interval or two the router is back on its own count.
        fake.metrics_text = vllm(running="NaN")
        assert wait_for(lambda: entry(live, "loud")["metrics"]["load_source"] == "gateway", 10)
        up = entry(live, "loud")
        assert "NaN" in up["metrics"]["error"]
        assert up["policy_load"]["running"] is None and up["policy_load"]["batch"] == 0
        assert up["speculation"] == "on"  # it was seen drafting; that stays known
        # /metrics gone (404), then back.
        fake.metrics_text = None
        assert wait_for(lambda: entry(live, "loud")["metrics"]["error"] == "answered 404", 10)
        fake.metrics_text = vllm(running=1, waiting=0)
        assert wait_for(lambda: entry(live, "loud")["metrics"]["error"] is None, 10)
        assert entry(live, "loud")["policy_load"]["batch"] == 1


def test_admin_backends_shows_a_replica_groups_combined_load(fake: FakeUpstream) -> None:
    fake.metrics_text = vllm(running=4, waiting=2, kv=0.5)
    members = [
        backend("r0", fake, health_interval=0.1, replica_group="pool"),
        backend("r1", fake, health_interval=0.1, replica_group="pool", scrape_metrics=False),
    ]
    with running_gateway(*members) as live:
        assert wait_for(lambda: entry(live, "r0")["metrics"]["load_source"] == "vllm", 10)
        (group,) = admin_backends(live)["groups"]
        assert group["name"] == "pool" and group["members"] == ["r0", "r1"]
        assert group["speculation"] is None
        # The group's arm: the mean over its replicas of each one's batch as it is known (r0's
        # scraped 4 + 2, r1's in-flight count 0 by this gateway); KV usage of those that report it.
        load = group["policy_load"]
        assert load["running"] == 3 and load["waiting"] == 0 and load["batch"] == 3
        assert load["kv_usage"] == 0.5 and load["healthy"] is True
