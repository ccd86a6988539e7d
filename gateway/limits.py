"""Rate limits: a token bucket per key (an API key, or a client address), with bounded state.

Framework-free: the HTTP layer decides what the key is (auth.py) and turns a refusal into a 429.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from specgate.gateway.protocol.errors import GatewayError

MAX_BUCKETS = 65_536  # limiter state is bounded: least recently seen keys are forgotten first


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per key: `rpm` requests per minute, bursts up to `rpm` / 6 (ten seconds' worth).

    At most `max_keys` buckets are kept; the least recently used go first (a forgotten key starts
    again with a full bucket, which costs an attacker as many addresses as it saves)."""

    rpm: int
    max_keys: int = MAX_BUCKETS
    buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict)

    @property
    def rate(self) -> float:
        return self.rpm / 60.0

    @property
    def burst(self) -> float:
        return max(1.0, self.rpm / 6.0)

    def _bucket(self, key: str, now: float) -> _Bucket:
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self.burst, now)
            while len(self.buckets) > self.max_keys:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(key)
        b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate)
        b.updated = now
        return b

    def take(self, key: str, now: float | None = None) -> float:
        """Spend one token; 0.0 if there was one, else the seconds until there will be."""
        if self.rpm <= 0:
            return 0.0
        b = self._bucket(key, time.monotonic() if now is None else now)
        if b.tokens < 1.0:
            return math.ceil((1.0 - b.tokens) / self.rate)
        b.tokens -= 1.0
        return 0.0

    def check(self, key: str, now: float | None = None) -> None:
        wait = self.take(key, now)
        if wait:
            raise GatewayError(
                429,
                f"Rate limit reached: {self.rpm} requests per minute.",
                code="rate_limit_exceeded",
                retry_after=wait,
            )


@dataclass(slots=True)
class RefusalBudget:
    """Refused requests (401, 413) per client address: once an address has spent its budget, every
    request from it is answered 429 until the bucket refills, before its key or body is looked at."""

    limiter: RateLimiter

    def exhausted(self, addr: str, now: float | None = None) -> bool:
        if self.limiter.rpm <= 0:
            return False
        b = self.limiter.buckets.get(addr)
        if b is None:
            return False
        now = time.monotonic() if now is None else now
        return min(self.limiter.burst, b.tokens + (now - b.updated) * self.limiter.rate) < 1.0

    def retry_after(self, addr: str) -> float:
        b = self.limiter.buckets.get(addr)
        if b is None or self.limiter.rpm <= 0:
            return 1.0
        return max(1.0, math.ceil((1.0 - b.tokens) / self.limiter.rate))

    def charge(self, addr: str) -> None:
        self.limiter.take(addr)
