"""API key checks and the per-key token-bucket rate limiter."""

from __future__ import annotations

import pytest

from specgate.gateway.http.auth import check_key, key_id
from specgate.gateway.limits import RateLimiter
from specgate.gateway.protocol.errors import GatewayError


def test_check_key() -> None:
    assert check_key("a", ["b", "a"]) and not check_key("c", ["a", "b"]) and not check_key(None, ["a"])


def test_key_id_hides_the_key() -> None:
    assert key_id("sk-123") == key_id("sk-123") != key_id("sk-124")
    assert "sk-123" not in key_id("sk-123")


def test_rate_limiter_bursts_then_refills() -> None:
    limiter = RateLimiter(rpm=60)  # one per second, bursts of 10
    for _ in range(10):
        limiter.check("k", now=100.0)
    with pytest.raises(GatewayError) as exc:
        limiter.check("k", now=100.0)
    assert exc.value.status == 429 and exc.value.retry_after == 1
    limiter.check("other", now=100.0)  # buckets are per key
    limiter.check("k", now=101.0)  # one second refills one request
    with pytest.raises(GatewayError):
        limiter.check("k", now=101.5)


def test_rate_limiter_off() -> None:
    limiter = RateLimiter(rpm=0)
    for _ in range(1000):
        limiter.check("k", now=0.0)
