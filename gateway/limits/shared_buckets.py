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

from specgate.gateway.limits.limiters import rate_limited, seconds_until_token
from specgate.gateway.limits.shared_table import Table


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


class SharedCounters:
    """In-flight counts per key that every worker of a gateway sees (a `Concurrency`).

    Each worker counts in entries of its own, (key, worker index, generation), and a key's count is
    the sum of every worker's current entry: a worker that dies holding requests would otherwise
    leave them counted forever. A worker's generation is bumped when it starts (and by the
    supervisor when it dies), so what the dead one held stops counting; its stale entries age out
    of the table like any least recently updated slot."""

    __slots__ = ("_gen_hashes", "index", "table", "workers")

    def __init__(self, table: Table, index: int, workers: int) -> None:
        if not 0 <= index < workers:
            raise ValueError(f"worker index {index} out of range for {workers} workers")
        self.table, self.index, self.workers = table, index, workers
        self._gen_hashes = [table.key_hash(f"\x00generation\x00{j}") for j in range(workers)]

    def bump(self, index: int) -> None:
        """Start a new generation for worker `index`: whatever its earlier one counted is dropped."""
        t, h = self.table, self._gen_hashes[index]
        t.acquire()
        try:
            s, _ = t.claim(h, 0.0, float("inf"))  # never the one evicted
            t.values[2 * s] += 1.0
        finally:
            t.release()

    def _entry(self, key: str, j: int, generation: float) -> int:
        return self.table.key_hash(f"{key}\x00{j}\x00{int(generation)}")

    def _generation(self, j: int) -> float:
        s = self.table.find(self._gen_hashes[j])
        return self.table.values[2 * s] if s >= 0 else 0.0

    def _total(self, key: str) -> tuple[int, int]:
        """(the key's count over every worker, the slot of this worker's entry or -1). Hold the lock."""
        t, values, total, mine = self.table, self.table.values, 0, -1
        for j in range(self.workers):
            s = t.find(self._entry(key, j, self._generation(j)))
            if s >= 0:
                total += max(0, int(values[2 * s]))
                if j == self.index:
                    mine = s
        return total, mine

    def acquire(self, key: str, limit: int) -> bool:
        t = self.table
        t.acquire()
        try:
            total, mine = self._total(key)
            if limit > 0 and total >= limit:
                return False
            if mine < 0:
                mine, _ = t.claim(self._entry(key, self.index, self._generation(self.index)), 0.0, 0.0)
            t.values[2 * mine] += 1.0
            t.values[2 * mine + 1] = time.monotonic()
            return True
        finally:
            t.release()

    def release(self, key: str) -> None:
        t = self.table
        t.acquire()
        try:
            s = t.find(self._entry(key, self.index, self._generation(self.index)))
            if s >= 0:
                t.values[2 * s] = max(0.0, t.values[2 * s] - 1.0)
                t.values[2 * s + 1] = time.monotonic()
        finally:
            t.release()

    def count(self, key: str) -> int:
        t = self.table
        t.acquire()
        try:
            return self._total(key)[0]
        finally:
            t.release()
