"""Whose fault a failed insert is, which decides what happens to its rows.

- The rows' (`row_fault`): the database refused a value, or it could not even be sent. The batch is
  split to find the row, which is quarantined; the rest go in.
- A lock lost to another writer (`transient`): not an outage. SQLite can answer "database is locked"
  at once, whatever its busy timeout (a WAL snapshot gone stale, a checkpoint or recovery in the
  way); PostgreSQL may pick this transaction as a deadlock's victim. The batch is tried again.
- Anything else is the database's (unreachable, timing out, a schema out of step): the rows wait
  in the spool until it is back.
"""

from __future__ import annotations

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, StatementError

_TRANSIENT_SQLSTATES = frozenset({"40P01", "40001"})  # deadlock detected, serialization failure


def row_fault(exc: Exception) -> bool:
    """Whether a failed insert is the rows' fault: a value the database refuses (DataError,
    IntegrityError) or one that could not even be sent (a binding or conversion error before the
    database saw it). Operational errors (timeouts, locks, connections) and programming errors (a
    schema out of step) are the database's."""
    if isinstance(exc, DataError | IntegrityError):
        return True
    if isinstance(exc, DBAPIError):
        return False
    return isinstance(exc, StatementError | ValueError | TypeError | OverflowError | UnicodeError)


def transient(exc: Exception) -> bool:
    """Whether the insert lost a lock or a deadlock to another writer (worth trying again soon)."""
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in _TRANSIENT_SQLSTATES:
        return True
    if str(getattr(orig, "sqlite_errorname", "")).startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
        return True
    message = str(orig).lower()
    return "database is locked" in message or "database is busy" in message
