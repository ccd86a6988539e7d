"""Token buckets and a revocation list kept in a shared-memory table (shared_table.py), so that
every worker process of a gateway reads and spends the same ones.

`SharedRateLimiter` has RateLimiter's semantics and methods (a `Limiter`): the buckets are in the
table instead of a dict. Times are time.monotonic(): CLOCK_MONOTONIC, which on Linux is one clock
for the whole machine (time since boot), not one per process, so a bucket one worker updated is
refilled correctly by another. Session expiries are wall-clock (time.time()), as in the cookie.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specgate.gateway.limits import rate_limited, seconds_until_token
from specgate.gateway.shared_table import Table


@dataclass(slots=True)
class SharedRateLimiter:
    """A token bucket per key: `rpm` a minute, bursts up to `burst` (default rpm / 6, as RateLimiter)."""

    table: Table = field(repr=False)
    rpm: float
    burst: float = 0.0  # 0: rpm / 6, at least 1

    def __post_init__(self) -> None:
        if self.burst < 0:
            raise ValueError("burst must not be negative")
        if not self.burst:
            self.burst = max(1.0, self.rpm / 6.0)

    @property
    def rate(self) -> float:
        return self.rpm / 60.0

    def take(self, key: str, now: float | None = None) -> float:
        """Spend one token; 0.0 if there was one, else the seconds until there will be."""
        if self.rpm <= 0:
            return 0.0
        t, h = self.table, self.table.key_hash(key)
        now = time.monotonic() if now is None else now
        rate, burst, values = self.rate, self.burst, t.values
        t.acquire()
        try:
            s, _ = t.claim(h, burst, now)  # a new key starts with a full bucket
            tokens = min(burst, values[2 * s] + (now - values[2 * s + 1]) * rate)
            values[2 * s] = tokens - 1.0 if tokens >= 1.0 else tokens
            values[2 * s + 1] = now
        finally:
            t.release()
        return seconds_until_token(tokens, rate)

    def wait(self, key: str, now: float | None = None) -> float:
        """What `take` would answer, without spending a token or making a bucket for `key`."""
        if self.rpm <= 0:
            return 0.0
        t, h = self.table, self.table.key_hash(key)
        now = time.monotonic() if now is None else now
        values = t.values
        t.acquire()
        try:
            s = t.find(h)
            if s < 0:
                return 0.0
            tokens, updated = values[2 * s], values[2 * s + 1]
        finally:
            t.release()
        return seconds_until_token(min(self.burst, tokens + (now - updated) * self.rate), self.rate)

    def check(self, key: str, now: float | None = None) -> None:
        wait = self.take(key, now)
        if wait:
            raise rate_limited(int(self.rpm), wait)

    def reset(self, key: str) -> None:
        """Fill `key`'s bucket again (it may have been forgotten already: then there is nothing to do)."""
        t, h = self.table, self.table.key_hash(key)
        t.acquire()
        try:
            s = t.find(h)
            if s >= 0:
                t.values[2 * s] = self.burst
        finally:
            t.release()


@dataclass(slots=True)
class SharedRevocations:
    """Session ids refused until they expire (wall-clock seconds). When a probe window is full the
    soonest-expiring entry goes first; an expired one is gone in effect already."""

    table: Table = field(repr=False)

    def add(self, sid: str, expires: float) -> None:
        t, h = self.table, self.table.key_hash(sid)
        t.acquire()
        try:
            s, _ = t.claim(h, 0.0, expires)
            t.values[2 * s + 1] = max(t.values[2 * s + 1], expires)
        finally:
            t.release()

    def revoked(self, sid: str, now: float | None = None) -> bool:
        t, h = self.table, self.table.key_hash(sid)
        now = time.time() if now is None else now
        t.acquire()
        try:
            s = t.find(h)
            return s >= 0 and t.values[2 * s + 1] > now
        finally:
            t.release()
