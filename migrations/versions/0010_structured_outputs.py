"""Structured outputs: requests.grammar, requests.num_forced_draft_tokens

`grammar` is the kind of output constraint a request ran under (json_schema, regex, choice, lark,
gbnf; NULL: none, or a backend that does not say); `num_forced_draft_tokens` counts the drafted
tokens its grammar forced (free drafts, verified like any other; NULL on rows written before, and
from external backends).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: adding them rewrites no rows on either database.
    op.add_column("requests", sa.Column("grammar", sa.String(16)))
    op.add_column("requests", sa.Column("num_forced_draft_tokens", sa.Integer()))


def downgrade() -> None:
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view or index reads these.
    op.drop_column("requests", "num_forced_draft_tokens")
    op.drop_column("requests", "grammar")
