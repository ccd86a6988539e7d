"""Limits key on what a client cannot mint: a valid key, else its address (X-Forwarded-For only from
trusted proxies). Refused traffic (401, 413) is limited too, and limiter state stays bounded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specgate.gateway.http.auth import client_address, limit_key, parse_networks
from specgate.gateway.limits.limiters import RateLimiter
from tests.gateway.live import LiveGateway, records_settle, start_gateway, tiny_settings

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def open_limited(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(
            str(tiny_llama_dir), rate_limit_rpm=30, trusted_proxies=["127.0.0.1"], log_requests=False
        )
    )
    yield live
    live.stop()


def _models(live: LiveGateway, **headers: str) -> int:
    return httpx.get(f"{live.url}/v1/models", headers=headers, timeout=10).status_code


def test_open_mode_limits_the_address_not_the_bearer_string(open_limited: LiveGateway) -> None:
    # A fresh bearer string per request used to buy a fresh bucket each time.
    statuses = [
        _models(open_limited, authorization=f"Bearer made-up-{i}", **{"x-forwarded-for": "203.0.113.7"})
        for i in range(12)
    ]
    assert statuses[:5] == [200] * 5 and 429 in statuses  # 30 rpm: a burst of five, then 429
    # Another client behind the same trusted proxy has its own budget.
    assert _models(open_limited, **{"x-forwarded-for": "203.0.113.8"}) == 200


def test_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    trusted = parse_networks(["10.0.0.0/8"])

    def addr(peer: str, xff: str) -> str:
        return client_address({"client": (peer, 1)}, {b"x-forwarded-for": xff.encode()}, trusted)

    assert addr("10.1.2.3", "198.51.100.1") == "198.51.100.1"  # from our proxy: believed
    assert addr("198.51.100.9", "1.2.3.4") == "198.51.100.9"  # from anyone else: ignored
    # The client may prepend anything; the nearest untrusted hop is what our proxy saw.
    assert addr("10.1.2.3", "6.6.6.6, 198.51.100.1, 10.9.9.9") == "198.51.100.1"
    assert addr("10.1.2.3", "not-an-ip") == "10.1.2.3"
    assert client_address({"client": ("10.1.2.3", 1)}, {b"x-forwarded-for": b"1.1.1.1"}, []) == "10.1.2.3"


@pytest.mark.slow
def test_refused_traffic_is_limited_per_address(tiny_llama_dir: Path) -> None:
    live = start_gateway(
        tiny_settings(
            str(tiny_llama_dir),
            api_keys=["k-real"],
            refused_rpm=60,  # bursts of ten refusals
            trusted_proxies=["127.0.0.1"],
            max_body_bytes=2048,
            log_requests=False,
        )
    )
    try:
        attacker = {"x-forwarded-for": "198.51.100.66"}
        guesses = [_models(live, authorization=f"Bearer guess-{i}", **attacker) for i in range(14)]
        assert guesses[:10] == [401] * 10 and guesses[10:] == [429] * 4
        # The address is turned away before any key or body is looked at, except for a request that
        # carries a valid key (a neighbour behind the same NAT guessing keys must not lock it out)
        # and for the probes.
        assert _models(live, authorization="Bearer guess-again", **attacker) == 429
        assert _models(live, authorization="Bearer k-real", **attacker) == 200
        assert httpx.get(f"{live.url}/metrics", headers=attacker).status_code == 200
        # Oversized bodies count too.
        big = {"x-forwarded-for": "198.51.100.67"}
        sizes = [
            httpx.post(f"{live.url}/v1/chat/completions", content=b"x" * 4096, headers=big).status_code
            for _ in range(12)
        ]
        assert sizes[:10] == [413] * 10 and sizes[10:] == [429] * 2
        # Everyone else is served as before.
        assert _models(live, authorization="Bearer k-real", **{"x-forwarded-for": "198.51.100.1"}) == 200
        records = [r for r in records_settle(live, 12) if r.endpoint == "chat"]
        assert len(records) == 12 and {r.status for r in records} == {413, 429}  # one record each
    finally:
        live.stop()


def test_ipv6_clients_are_limited_by_their_64() -> None:
    assert limit_key("2001:db8:1:2:aaaa::1") == limit_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert limit_key("2001:db8:1:3::1") != limit_key("2001:db8:1:2::1")
    assert limit_key("203.0.113.7") == "203.0.113.7" and limit_key("::ffff:203.0.113.7") == "203.0.113.7"


def test_limiter_state_is_bounded() -> None:
    limiter = RateLimiter(rpm=60, max_keys=100)
    for i in range(10_000):
        limiter.take(f"addr-{i}", now=float(i))
    assert len(limiter.buckets) == 100
    assert list(limiter.buckets)[-1] == "addr-9999"  # the most recent stay
