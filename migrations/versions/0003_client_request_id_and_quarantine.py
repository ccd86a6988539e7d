"""requests.client_request_id (the gateway's own id keys the row) and telemetry_quarantine

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("requests", sa.Column("client_request_id", sa.String(128)))
    op.create_index(op.f("ix_requests_client_request_id"), "requests", ["client_request_id"])
    op.create_table(
        "telemetry_quarantine",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("request_id", sa.String(128)),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("row", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_telemetry_quarantine")),
    )
    op.create_index(
        op.f("ix_telemetry_quarantine_quarantined_at"), "telemetry_quarantine", ["quarantined_at"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_telemetry_quarantine_quarantined_at"), table_name="telemetry_quarantine")
    op.drop_table("telemetry_quarantine")
    op.drop_index(op.f("ix_requests_client_request_id"), table_name="requests")
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view reads this one.
    op.drop_column("requests", "client_request_id")
