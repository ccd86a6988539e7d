"""Request timings take the names the engine and the API use (vLLM's); v_recent_errors follows

received_at -> arrival_time, first_token_at -> first_token_time, finished_at -> finished_time,
queue_ms -> queue_time_ms: the names of `metrics` in a response and of the engine's request stats,
from the engine to the column. The indexes on the arrival time are renamed with it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

RENAMES = (
    ("received_at", "arrival_time"),
    ("first_token_at", "first_token_time"),
    ("finished_at", "finished_time"),
    ("queue_ms", "queue_time_ms"),
)
# The indexes that hold the arrival time, by their other columns (the naming convention names
# them after all of their columns).
INDEXED_WITH = ((), ("model",), ("backend", "spec_method"), ("outcome",))


def upgrade() -> None:
    _move(dict(RENAMES))


def downgrade() -> None:
    _move({new: old for old, new in RENAMES})


def _move(mapping: dict[str, str]) -> None:
    old_arrival = next(old for old, new in mapping.items() if new in ("arrival_time", "received_at"))
    arrival = mapping[old_arrival]
    postgres = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP VIEW IF EXISTS v_recent_errors")
    if not postgres:  # SQLite cannot rename an index: it is made again (the table is local and small)
        for columns in INDEXED_WITH:
            op.drop_index("ix_requests_" + "_".join((*columns, old_arrival)), table_name="requests")
    # SQLite (3.25+) and PostgreSQL both rename a column in place.
    for old, new in mapping.items():
        op.alter_column("requests", old, new_column_name=new)
    for columns in INDEXED_WITH:
        old_name, new_name = ("ix_requests_" + "_".join((*columns, c)) for c in (old_arrival, arrival))
        if postgres:  # renamed in place: a production table's indexes are not rebuilt
            op.execute(f"ALTER INDEX {old_name} RENAME TO {new_name}")
        else:
            op.create_index(new_name, "requests", [*columns, arrival])
    op.execute(
        f"""
        CREATE VIEW v_recent_errors AS
        SELECT {arrival}, request_id, client_request_id, model, backend, endpoint, status, error_code, outcome
        FROM requests
        WHERE outcome = 'error'
        ORDER BY {arrival} DESC
        """
    )
