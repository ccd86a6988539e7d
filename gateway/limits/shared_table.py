"""A fixed-size hash table in shared memory: the storage under shared.py.

Open addressing on a keyed 64-bit blake2b hash of the key (keyed with a secret drawn per gateway,
so nobody can choose keys that land in one probe window to evict someone else's entry). A slot is
(hash, a, b); what a and b mean is the caller's (a bucket: tokens and when it was last updated; a
revoked session: its expiry in b). A lookup probes at most PROBE slots; a key that finds neither
itself nor a free slot there takes over the slot of that window with the smallest b (the least
recently updated bucket, the soonest-expiring revocation), as RateLimiter forgets its least
recently used key. Slots are never freed, so a free slot ends a probe: the key is not further on.

Callers hold the table's lock (`acquire` / `release`) around `find` / `claim` and their reads and
writes of the slot; those do a few loads and stores and nothing else (the hash is computed before
the lock is taken), so the lock is held for microseconds. A waiter that has waited STALE_LOCK
seconds concludes that the holder died holding it (a worker killed at that instant: a POSIX
semaphore is not released for the dead) and carries on as the holder; were the holder only slow,
the worst is one bucket updated by two processes at once (a token more or less), and its own
release, now one too many, is ignored.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

SLOT_BYTES = 24  # the hash (u64), a (f64), b (f64)
BUCKET_SLOTS = 1 << 17  # twice limits.MAX_BUCKETS: open addressing wants room
REVOKED_SLOTS = 1 << 15  # beyond session.MAX_REVOKED, for the same reason
PROBE = 8
STALE_LOCK = 1.0  # seconds; the critical sections take microseconds

logger = logging.getLogger("specgate.gateway")
TABLES = ("api", "refusals", "signins", "revoked", "inflight")


@dataclass(frozen=True, slots=True)
class TableSpec:
    name: str
    offset: int  # bytes into the segment
    slots: int  # a power of two

    def __post_init__(self) -> None:
        if self.slots < PROBE or self.slots & (self.slots - 1):
            raise ValueError(f"table {self.name}: {self.slots} slots is not a power of two >= {PROBE}")
        if self.offset < 0 or self.offset % 8:
            raise ValueError(f"table {self.name}: offset {self.offset} is not 8-byte aligned")

    @property
    def size(self) -> int:
        return self.slots * SLOT_BYTES


def layout(bucket_slots: int = BUCKET_SLOTS, revoked_slots: int = REVOKED_SLOTS) -> tuple[TableSpec, ...]:
    """The tables of one segment, back to back: ~9.8 MB at the defaults."""
    specs: list[TableSpec] = []
    offset = 0
    for name in TABLES:
        specs.append(TableSpec(name, offset, revoked_slots if name == "revoked" else bucket_slots))
        offset += specs[-1].size
    return tuple(specs)


class Table:
    """One table of an attached segment: `hashes[i]` and `values[2i]` (a), `values[2i + 1]` (b)."""

    __slots__ = ("_keyed", "hashes", "lock", "mask", "values")

    def __init__(self, buf: memoryview, spec: TableSpec, lock: Any, secret: bytes) -> None:
        n = spec.slots
        self.hashes = buf[spec.offset : spec.offset + 8 * n].cast("Q")
        self.values = buf[spec.offset + 8 * n : spec.offset + spec.size].cast("d")
        self.mask = n - 1
        self.lock = lock
        self._keyed = hashlib.blake2b(digest_size=8, key=secret)  # copied per key: no key setup each time

    def key_hash(self, key: str) -> int:
        digest = self._keyed.copy()
        digest.update(key.encode("utf-8", "surrogatepass"))
        return int.from_bytes(digest.digest(), "little") or 1  # 0 marks a free slot

    def acquire(self) -> None:
        if not self.lock.acquire(True, STALE_LOCK):
            logger.error("the shared limit tables' lock was held for %ss; taking it over", STALE_LOCK)

    def release(self) -> None:
        try:  # noqa: SIM105 (not contextlib.suppress: this is on every request's path)
            self.lock.release()
        except ValueError:  # released by a waiter that took it over (see the module's docstring)
            pass

    def find(self, h: int) -> int:
        """The slot holding `h`, or -1. Hold the lock."""
        hashes, mask = self.hashes, self.mask
        for i in range(h, h + PROBE):
            got = hashes[i & mask]
            if got == h:
                return i & mask
            if not got:
                return -1
        return -1

    def claim(self, h: int, a: float, b: float) -> tuple[int, bool]:
        """The slot holding `h` and False, or else a slot just given to `h` (set to a, b) and True.
        Hold the lock."""
        hashes, values, mask = self.hashes, self.values, self.mask
        victim, oldest = -1, float("inf")
        for i in range(h, h + PROBE):
            s = i & mask
            got = hashes[s]
            if got == h:
                return s, False
            if not got:
                victim = s
                break
            if values[2 * s + 1] < oldest:
                victim, oldest = s, values[2 * s + 1]
        hashes[victim] = h
        values[2 * victim] = a
        values[2 * victim + 1] = b
        return victim, True

    def detach(self) -> None:
        """Let go of the views (the segment can only be closed once nothing points into it)."""
        self.hashes.release()
        self.values.release()
