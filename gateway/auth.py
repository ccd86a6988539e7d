"""Bearer API keys for /v1 and a separate admin key for /admin, plus a per-key rate limit.

Keys are compared in constant time and never logged; a request is identified in records by a short
hash of its key.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field

from starlette.requests import Request

from gateway.errors import APIError


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_key(presented: str | None, accepted: list[str]) -> bool:
    if presented is None:
        return False
    ok = False
    for key in accepted:  # no early exit: the time taken does not depend on which key matched
        ok |= hmac.compare_digest(presented.encode(), key.encode())
    return ok


def unauthorized(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(401, message, code="invalid_api_key")


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per key: `rpm` requests per minute, bursts up to `rpm` / 6 (ten seconds' worth)."""

    rpm: int
    buckets: dict[str, _Bucket] = field(default_factory=dict)

    def check(self, key: str, now: float | None = None) -> None:
        if self.rpm <= 0:
            return
        now = time.monotonic() if now is None else now
        rate = self.rpm / 60.0
        burst = max(1.0, self.rpm / 6.0)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(burst, now)
        b.tokens = min(burst, b.tokens + (now - b.updated) * rate)
        b.updated = now
        if b.tokens < 1.0:
            wait = math.ceil((1.0 - b.tokens) / rate)
            raise APIError(
                429,
                f"Rate limit reached: {self.rpm} requests per minute.",
                code="rate_limit_exceeded",
                retry_after=wait,
            )
        b.tokens -= 1.0
