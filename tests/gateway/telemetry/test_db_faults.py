"""Whose fault a failed insert is: the rows' (quarantine them), a lost lock (retry) or the database's."""

from __future__ import annotations

import sqlite3

import psycopg.errors
from sqlalchemy.exc import DataError, IntegrityError, OperationalError, ProgrammingError, StatementError

from specgate.gateway.telemetry.db_faults import row_fault, transient


def test_only_lock_conflicts_count_as_transient() -> None:
    locked = OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
    assert transient(locked)
    deadlock = OperationalError("INSERT", {}, psycopg.errors.DeadlockDetected("deadlock detected"))
    assert transient(deadlock)
    refused = OperationalError("INSERT", {}, sqlite3.OperationalError("no such table: requests"))
    assert not transient(refused)
    assert not transient(ValueError("database is locked"))  # not the database's answer


def test_only_the_rows_own_faults_are_quarantined() -> None:
    """A timeout, a lock or a lost connection is the database's fault: those rows wait in the spool."""
    orig = sqlite3.Error("x")
    assert row_fault(DataError("insert", {}, orig)) and row_fault(IntegrityError("insert", {}, orig))
    assert row_fault(StatementError("bind", "insert", {}, UnicodeEncodeError("utf-8", "x", 0, 1, "y")))
    assert row_fault(OverflowError("date out of range"))
    assert not row_fault(OperationalError("insert", {}, orig))  # locked, timed out, gone
    assert not row_fault(ProgrammingError("insert", {}, orig))  # a schema out of step
