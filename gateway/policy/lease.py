"""One policy retrain at a time across every gateway on one telemetry database.

Replicas on one PostgreSQL (and the workers of one `serve`) share the versions table; two
retrains at once would fit on the same rows twice and race to activate. A retrain first takes a
lease, without waiting (a busy lease is a 409 for the operator and a skipped round for a schedule):

- PostgreSQL: a session-level advisory lock (`pg_try_advisory_lock`) on a connection held for the
  retrain; the server frees it if the holder's process dies, so a crash never wedges retraining.
- SQLite: `flock` on a file beside the database (`<db>.retrain-lock`); the kernel frees it with the
  process. SQLite replicas share a machine by construction.
- Anything else (an in-memory database): a lock in this process.
"""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Protocol

from sqlalchemy import Connection, Engine, text

# The advisory lock's key: any fixed 64-bit number no other application on the database uses.
ADVISORY_KEY = 0x5BEC6A7E_0001
_IN_PROCESS = threading.Lock()


class Lease(Protocol):
    def release(self) -> None: ...


class _AdvisoryLease:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def release(self) -> None:
        try:
            self.conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": ADVISORY_KEY})
            self.conn.commit()
        finally:
            self.conn.close()


class _FileLease:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


class _ThreadLease:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def release(self) -> None:
        self.lock.release()


def try_lock(lock: threading.Lock) -> Lease | None:
    return _ThreadLease(lock) if lock.acquire(blocking=False) else None


def try_retrain_lease(engine: Engine) -> Lease | None:
    """The retrain lease for this database, or None if another process (or thread) holds it."""
    if engine.dialect.name == "postgresql":
        conn = engine.connect()
        try:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_KEY}).scalar())
            conn.commit()  # the lock is the session's: it outlives the transaction
        except BaseException:
            conn.close()
            raise
        if not got:
            conn.close()
            return None
        return _AdvisoryLease(conn)
    database = engine.url.database
    if engine.dialect.name == "sqlite" and database and database != ":memory:":
        fd = os.open(f"{database}.retrain-lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return _FileLease(fd)
    return try_lock(_IN_PROCESS)
