"""policy_versions: fitted and edited routing policies, one active

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("parent_version", sa.Integer()),
        sa.Column("promoted_at", sa.DateTime(timezone=True)),
        sa.Column("window_start", sa.DateTime(timezone=True)),
        sa.Column("window_end", sa.DateTime(timezone=True)),
        sa.Column("train_rows", sa.Integer()),
        sa.Column("metrics", sa.JSON()),
        sa.Column("artifact", sa.JSON(), nullable=False),
        sa.Column("note", sa.Text()),
        sa.PrimaryKeyConstraint("version", name=op.f("pk_policy_versions")),
    )
    op.create_index(op.f("ix_policy_versions_status"), "policy_versions", ["status"])


def downgrade() -> None:
    op.drop_index(op.f("ix_policy_versions_status"), table_name="policy_versions")
    op.drop_table("policy_versions")
