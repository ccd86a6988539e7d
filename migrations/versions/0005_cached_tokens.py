"""requests.cached_tokens: prompt tokens served from the prefix cache

Filled from the embedded engine's prefix cache, and from external backends that report
usage.prompt_tokens_details.cached_tokens; NULL where the backend does not say (rows before it too).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: adding it rewrites no rows on either database.
    op.add_column("requests", sa.Column("cached_tokens", sa.Integer()))


def downgrade() -> None:
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view reads this one.
    op.drop_column("requests", "cached_tokens")
