"""The telemetry tests' databases (a SQLite file, a fresh PostgreSQL database, both by `db_url`)
for the HTTP tests that read telemetry back through the admin API."""

from __future__ import annotations

from tests.gateway.telemetry.conftest import db_url, pg_url, sqlite_url

__all__ = ["db_url", "pg_url", "sqlite_url"]
