"""Replica affinity and propensities: requests.affinity_group, .affinity_source, .affinity_hit, .propensity

Where a request's route ran through a replica group (backends with one `replica_group`): the group,
what keyed its conversation (user, prefix, or none: least loaded) and whether the conversation's home
replica served it; and the probability the routing policy had of choosing the arm it chose (for
off-policy evaluation). NULL elsewhere and on rows written before this revision.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: adding them rewrites no rows on either database.
    op.add_column("requests", sa.Column("affinity_group", sa.String(64)))
    op.add_column("requests", sa.Column("affinity_source", sa.String(16)))
    op.add_column("requests", sa.Column("affinity_hit", sa.Boolean()))
    op.add_column("requests", sa.Column("propensity", sa.Float()))


def downgrade() -> None:
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view or index reads these.
    op.drop_column("requests", "propensity")
    op.drop_column("requests", "affinity_hit")
    op.drop_column("requests", "affinity_source")
    op.drop_column("requests", "affinity_group")
