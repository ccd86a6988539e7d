"""External backends as arms: latency targets, the serving backend's batch, prefix matches

`slo_ttft_ms` / `slo_tpot_ms` are the request's latency targets (its x-slo-* headers or its key's
defaults; NULL: none), `slo_met` whether it met them (NULL: no target, or a latency unknown);
`load_backend_batch` is the serving backend's requests running and waiting as the router saw them
(its /metrics, else this gateway's in-flight count); `prefix_matched_blocks` how many of the
prompt's blocks prefix affinity believed the chosen replica held (to check against cached_tokens).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: adding them rewrites no rows on either database.
    op.add_column("requests", sa.Column("slo_ttft_ms", sa.Float()))
    op.add_column("requests", sa.Column("slo_tpot_ms", sa.Float()))
    op.add_column("requests", sa.Column("slo_met", sa.Boolean()))
    op.add_column("requests", sa.Column("load_backend_batch", sa.Integer()))
    op.add_column("requests", sa.Column("prefix_matched_blocks", sa.Integer()))


def downgrade() -> None:
    # SQLite (3.35+) and PostgreSQL both drop a column in place; no view or index reads these.
    for name in ("prefix_matched_blocks", "load_backend_batch", "slo_met", "slo_tpot_ms", "slo_ttft_ms"):
        op.drop_column("requests", name)
