"""Rate limits: a token bucket per key (an API key, or a client address), with bounded state.

Framework-free: the HTTP layer decides what the key is (auth.py) and turns a refusal into a 429.
`RateLimiter` keeps its buckets in this process; with several worker processes the gateway uses
`shared.SharedRateLimiter` (shared.py) instead, whose buckets live in shared memory so the workers
enforce one limit between them, not one each. Both are a `Limiter`.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from specgate.gateway.protocol.errors import GatewayError

MAX_BUCKETS = 65_536  # limiter state is bounded: least recently seen keys are forgotten first


class Limiter(Protocol):
    """A token bucket per key, `rpm` requests per minute (0 or less: no limit)."""

    @property
    def rpm(self) -> float: ...

    def take(self, key: str, now: float | None = None) -> float: ...

    def wait(self, key: str, now: float | None = None) -> float: ...

    def check(self, key: str, now: float | None = None) -> None: ...


def seconds_until_token(tokens: float, rate: float) -> float:
    """Seconds until a bucket holding `tokens` and refilling `rate` a second has a whole one (0.0:
    it has one now). Whole seconds: they become a Retry-After header."""
    return 0.0 if tokens >= 1.0 else math.ceil((1.0 - tokens) / rate)


def rate_limited(rpm: float, wait: float) -> GatewayError:
    return GatewayError(
        429, f"Rate limit reached: {rpm} requests per minute.", code="rate_limit_exceeded", retry_after=wait
    )


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
        b.tokens = self._refilled(b, now)
        b.updated = now
        return b

    def _refilled(self, b: _Bucket, now: float) -> float:
        return min(self.burst, b.tokens + (now - b.updated) * self.rate)

    def _wait(self, tokens: float) -> float:
        return seconds_until_token(tokens, self.rate)

    def take(self, key: str, now: float | None = None) -> float:
        """Spend one token; 0.0 if there was one, else the seconds until there will be."""
        if self.rpm <= 0:
            return 0.0
        b = self._bucket(key, time.monotonic() if now is None else now)
        wait = self._wait(b.tokens)
        if not wait:
            b.tokens -= 1.0
        return wait

    def wait(self, key: str, now: float | None = None) -> float:
        """What `take` would answer, without spending a token or making a bucket for `key`."""
        b = self.buckets.get(key)
        if self.rpm <= 0 or b is None:
            return 0.0
        return self._wait(self._refilled(b, time.monotonic() if now is None else now))

    def check(self, key: str, now: float | None = None) -> None:
        wait = self.take(key, now)
        if wait:
            raise rate_limited(self.rpm, wait)


@dataclass(slots=True)
class RefusalBudget:
    """Refused requests (401, 413) per client address: once an address has spent its budget, every
    request from it is answered 429 until the bucket refills, before its key or body is looked at."""

    limiter: Limiter

    def exhausted(self, addr: str, now: float | None = None) -> bool:
        return self.limiter.wait(addr, now) > 0

    def retry_after(self, addr: str) -> float:
        return max(1.0, self.limiter.wait(addr))

    def charge(self, addr: str) -> None:
        self.limiter.take(addr)


class Concurrency(Protocol):
    """Requests in flight per key: `acquire` counts one if the key is under `limit` (0: no cap) and
    says whether it did; `release` gives one back."""

    def acquire(self, key: str, limit: int) -> bool: ...

    def release(self, key: str) -> None: ...

    def count(self, key: str) -> int: ...


@dataclass(slots=True)
class ConcurrencyLimiter:
    """In-flight counts per key in this process (a key's entry goes once its count is back to 0)."""

    counts: Counter[str] = field(default_factory=Counter)

    def acquire(self, key: str, limit: int) -> bool:
        if limit > 0 and self.counts[key] >= limit:
            return False
        self.counts[key] += 1
        return True

    def release(self, key: str) -> None:
        left = self.counts[key] - 1
        if left > 0:
            self.counts[key] = left
        else:
            self.counts.pop(key, None)

    def count(self, key: str) -> int:
        return self.counts[key]


Held = list[tuple[Concurrency, str]]  # the in-flight slots one request holds: (counts, key)


def release(held: Held | None) -> None:
    """Give back every slot in `held`, emptying it, so that whoever ends the request first frees
    them once: the answer or a stream's last event (before the client can send its next request),
    an error answer, or the middleware when the request is over, whatever happened."""
    while held:
        counts, key = held.pop()
        counts.release(key)


def too_many_in_flight(what: str, limit: int, retry_after: float = 1.0) -> GatewayError:
    return GatewayError(
        429,
        f"Too many {what} at once for this key (the limit is {limit}); wait for one to finish.",
        code="concurrency_limit_exceeded",
        retry_after=retry_after,
    )
