"""Stored Responses API responses: the `responses` table

One row per response created with `store` (the default): its owner (the API key's id, or the
client's address bucket in open mode), model, status, token counts, the input items (the stored
conversation it continued first), the output items and the response object as answered.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("response_id", sa.String(160), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("previous_response_id", sa.String(160)),
        sa.Column("input_tokens", sa.Integer()),
        sa.Column("output_tokens", sa.Integer()),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("output_items", sa.JSON(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("response_id", name="pk_responses"),
    )
    op.create_index("ix_responses_owner_created_at", "responses", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_owner_created_at", table_name="responses")
    op.drop_table("responses")
