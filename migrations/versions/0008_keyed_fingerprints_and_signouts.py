"""Keyed API-key fingerprints and durable sign-outs: requests.api_key_id re-marked, dashboard_revocations

Until now `api_key_id` was the first 48 bits of an unsalted SHA-256 of the key: a weak key can be
guessed offline from a copy of the database. New rows carry an HMAC under the gateway's secret. The
old values cannot be re-keyed (the keys are not here), so each distinct one is replaced by a random
label, `legacy-<12 hex>`: rows of one key still group together, and nothing about the key is left.

`dashboard_revocations` holds signed-out dashboard sessions until their cookies expire, so that no
worker, replica or restart accepts a signed-out cookie again.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dashboard_revocations",
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name="pk_dashboard_revocations"),
    )
    op.create_index("ix_dashboard_revocations_expires_at", "dashboard_revocations", ["expires_at"])
    conn = op.get_bind()
    requests = sa.table("requests", sa.column("api_key_id", sa.String(32)))
    old = conn.execute(
        sa.select(requests.c.api_key_id).where(requests.c.api_key_id.like("key-%")).distinct()
    ).scalars()
    for value in list(old):
        label = f"legacy-{secrets.token_hex(6)}"
        conn.execute(requests.update().where(requests.c.api_key_id == value).values(api_key_id=label))


def downgrade() -> None:
    # The re-marked fingerprints stay as they are: the bare hashes they replaced are gone for good
    # (that was the point), and a `legacy-` label is as valid an id to the older code.
    op.drop_index("ix_dashboard_revocations_expires_at", table_name="dashboard_revocations")
    op.drop_table("dashboard_revocations")
