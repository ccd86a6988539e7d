"""Draft trees: requests.num_tree_drafts, requests.mean_draft_nodes, spec_steps.depth

A step that verified a draft tree drafted `k_proposed` nodes at most `depth` deep; a chain's depth is
its length. NULL on rows written before trees (and from external backends).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: adding them rewrites no rows on either database.
    op.add_column("requests", sa.Column("num_tree_drafts", sa.Integer()))
    op.add_column("requests", sa.Column("mean_draft_nodes", sa.Float()))
    op.add_column("spec_steps", sa.Column("depth", sa.Integer()))


def downgrade() -> None:
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view or index reads these.
    op.drop_column("spec_steps", "depth")
    op.drop_column("requests", "mean_draft_nodes")
    op.drop_column("requests", "num_tree_drafts")
