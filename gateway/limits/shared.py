"""Limit state that the worker processes of one gateway (`specgate serve --workers N`) share.

Without it each worker would keep its own buckets and a client would get N times every limit. The
supervisor creates one shared-memory segment (`SharedLimits.create(settings)`) and hands the
picklable handle to each worker in its spawn arguments (`WorkerContext.shared_limits`); a worker
attaches it by name (`handle.attach()`, once per process) and gets `SharedTables`:

- `api`: the /v1 rate limit (per key, or per client address in open mode), a `Limiter`;
- `refusals`: the refusal budget's buckets (401 / 413 answers per client address), a `Limiter`;
- `signins`: failed dashboard sign-ins per client address (`SharedSignInGuard` uses it);
- `revoked`: signed-out dashboard sessions until they expire (`SessionSigner` uses it);
- `inflight`: requests and streams in flight per key (`in_flight(index, workers)`, SharedCounters).

The tables themselves (hashing, probing, eviction) are shared_table.py. Every read and write holds
one process-shared lock, a POSIX semaphore: no system call unless another process holds it.
Single-process gateways use none of this: limits.RateLimiter and friends, in memory.
"""

from __future__ import annotations

import multiprocessing
import secrets
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from specgate.gateway.limits.shared_buckets import SharedCounters, SharedRateLimiter, SharedRevocations
from specgate.gateway.limits.shared_table import TABLES, Table, TableSpec, layout
from specgate.gateway.settings import Settings


@dataclass(slots=True)
class SharedTables:
    """One process's attachment: the limiters and the revocation list, over the shared tables."""

    api: SharedRateLimiter
    refusals: SharedRateLimiter
    signins: SharedRateLimiter  # max_failed_signins per signin_lockout, bursts of max_failed_signins
    revoked: SharedRevocations
    tables: dict[str, Table] = field(repr=False)

    def in_flight(self, index: int, workers: int) -> SharedCounters:
        """Worker `index`'s view of the in-flight counts (it calls `bump(index)` once, at start)."""
        return SharedCounters(self.tables["inflight"], index, workers)

    def release(self) -> None:
        for table in self.tables.values():
            table.detach()


@dataclass(slots=True, eq=False)
class SharedLimits:
    """The picklable handle: the segment's name, its lock, the hash secret, the table layout and
    the limits (from the supervisor's settings, so that every worker enforces the same ones).

    Pickle it only into a process being spawned (the lock refuses anything else), created with the
    multiprocessing context the workers are started with. The creator owns the segment: it calls
    `close()`, which unlinks it, once the workers are gone; a worker never unlinks it."""

    name: str
    lock: Any  # a multiprocessing Lock, inherited at spawn
    secret: bytes
    tables: tuple[TableSpec, ...]
    rate_limit_rpm: int
    refused_rpm: int
    max_failed_signins: int
    signin_lockout: float
    _shm: SharedMemory | None = field(default=None, repr=False)
    _owner: bool = field(default=False, repr=False)
    _attached: SharedTables | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the hash secret must be at least 16 bytes")
        if self.max_failed_signins < 1 or self.signin_lockout <= 0:
            raise ValueError("invalid sign-in limits")
        if sorted(t.name for t in self.tables) != sorted(TABLES):
            raise ValueError(f"the tables must be {TABLES}")

    @classmethod
    def create(cls, settings: Settings, ctx: Any = None, tables: tuple[TableSpec, ...] = ()) -> SharedLimits:
        """A new zeroed segment (a zero hash is a free slot) and its lock; `ctx`: the
        multiprocessing context the workers are started with (default: spawn)."""
        tables = tables or layout()
        ctx = ctx or multiprocessing.get_context("spawn")
        size = max(t.offset + t.size for t in tables)
        shm = SharedMemory(create=True, size=size)
        assert shm.buf is not None
        shm.buf[:size] = bytes(size)  # fresh POSIX shared memory reads as zeroes; don't rely on it
        return cls(
            name=shm.name,
            lock=ctx.Lock(),
            secret=secrets.token_bytes(32),
            tables=tables,
            rate_limit_rpm=settings.rate_limit_rpm,
            refused_rpm=settings.refused_rpm,
            max_failed_signins=settings.ui.max_failed_signins,
            signin_lockout=settings.ui.signin_lockout,
            _shm=shm,
            _owner=True,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # The mapping and this process's attachment stay here; the receiver attaches by name.
        fields = (self.name, self.lock, self.secret, self.tables)
        limits = (self.rate_limit_rpm, self.refused_rpm, self.max_failed_signins, self.signin_lockout)
        return (SharedLimits, (*fields, *limits))

    def attach(self) -> SharedTables:
        """This process's view of the tables: mapped on the first call, the same one after."""
        if self._attached is not None:
            return self._attached
        if self._shm is None:
            # SharedMemory registers the name with the resource tracker, which spawned workers share
            # with the supervisor (a set: registering twice is once); only the creator unlinks.
            self._shm = SharedMemory(name=self.name)
        buf = self._shm.buf
        assert buf is not None
        tables = {t.name: Table(buf, t, self.lock, self.secret) for t in self.tables}
        lockout_rpm = self.max_failed_signins * 60.0 / self.signin_lockout
        self._attached = SharedTables(
            api=SharedRateLimiter(tables["api"], self.rate_limit_rpm),
            refusals=SharedRateLimiter(tables["refusals"], self.refused_rpm),
            signins=SharedRateLimiter(tables["signins"], lockout_rpm, burst=float(self.max_failed_signins)),
            revoked=SharedRevocations(tables["revoked"]),
            tables=tables,
        )
        return self._attached

    def close(self) -> None:
        """Drop this process's mapping (nothing may use its limiters after); the creator also
        removes the segment."""
        if self._attached is not None:
            self._attached.release()
            self._attached = None
        if self._shm is not None:
            self._shm.close()
            if self._owner:
                self._shm.unlink()
            self._shm = None


def attached(handle: SharedLimits | None) -> SharedTables | None:
    """The tables of a worker context's handle (None: a single-process gateway)."""
    return handle.attach() if handle is not None else None
