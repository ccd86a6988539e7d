"""API key checks and the per-key token-bucket rate limiter."""

from __future__ import annotations

import pytest

from specgate.gateway.http.auth import check_key
from specgate.gateway.keyring import KeyIds
from specgate.gateway.limits.limiters import RateLimiter
from specgate.gateway.protocol.errors import GatewayError


def test_check_key() -> None:
    assert check_key("a", ["b", "a"]) and not check_key("c", ["a", "b"]) and not check_key(None, ["a"])


def test_key_ids_are_keyed_fingerprints() -> None:
    ids, other = KeyIds(b"s" * 32), KeyIds(b"t" * 32)
    assert ids.of("sk-123") == ids.of("sk-123") != ids.of("sk-124")
    assert "sk-123" not in ids.of("sk-123")
    # Under another secret the same key has another id: a copy of the rows alone tells nothing.
    assert ids.of("sk-123") != other.of("sk-123")
    # Not the bare hash the rows carried before: nothing to guess offline without the secret.
    import hashlib

    bare = hashlib.sha256(b"sk-123").hexdigest()
    assert bare[:12] not in ids.of("sk-123") and ids.of("sk-123").startswith("key-")
    with pytest.raises(ValueError):
        KeyIds(b"short")


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
