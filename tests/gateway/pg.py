"""A fresh database on the machine's PostgreSQL (127.0.0.1:5432, trust auth; .ci/run starts it)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from specgate.gateway.telemetry import schema

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database on the machine's PostgreSQL at the schema's head, dropped afterwards."""
    name = f"specgate_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(PG_ADMIN, connect_timeout=3, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        # The server is part of the test environment (.ci/run starts it): an error, not a skip.
        pytest.fail("PostgreSQL is not running on 127.0.0.1:5432 (see .ci/run for how to start it)")
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        schema.upgrade(url)
        yield url
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
