"""Speculation columns take vLLM's names; the views follow

num_spec_steps -> num_drafts, num_accepted_draft_tokens -> num_accepted_tokens,
acceptance_histogram -> num_accepted_tokens_per_pos (the names the API and the engine use).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

RENAMES = (
    ("num_spec_steps", "num_drafts"),
    ("num_accepted_draft_tokens", "num_accepted_tokens"),
    ("acceptance_histogram", "num_accepted_tokens_per_pos"),
)
VIEWS = ("v_acceptance_by_class", "v_route_performance", "v_recent_errors")


def upgrade() -> None:
    _drop_views()
    _rename({old: new for old, new in RENAMES})
    _create_views(drafts="num_drafts", accepted="num_accepted_tokens", errors_extra=", client_request_id")


def downgrade() -> None:
    _drop_views()
    _rename({new: old for old, new in RENAMES})
    _create_views(drafts="num_spec_steps", accepted="num_accepted_draft_tokens", errors_extra="")


def _drop_views() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")


def _rename(mapping: dict[str, str]) -> None:
    # SQLite (3.25+) and PostgreSQL both rename a column in place; the views are rebuilt after.
    for old, new in mapping.items():
        op.alter_column("requests", old, new_column_name=new)


def _create_views(drafts: str, accepted: str, errors_extra: str) -> None:
    postgres = op.get_bind().dialect.name == "postgresql"

    def pct(p: float, column: str) -> str:
        # SQLite has no percentile aggregate; the column stays so queries run on both.
        return f"percentile_cont({p}) WITHIN GROUP (ORDER BY {column})" if postgres else "NULL"

    op.execute(
        f"""
        CREATE VIEW v_acceptance_by_class AS
        SELECT COALESCE(workload_class, 'unclassified') AS workload_class,
               COALESCE(spec_method, 'off') AS spec_method,
               COUNT(*) AS requests,
               SUM(num_draft_tokens) AS draft_tokens,
               SUM({accepted}) AS accepted_tokens,
               CAST(SUM({accepted}) AS FLOAT) / NULLIF(SUM(num_draft_tokens), 0) AS acceptance_rate,
               AVG(CASE WHEN {drafts} > 0 THEN mean_acceptance_length END) AS mean_acceptance_length,
               AVG(tokens_per_s) AS mean_tokens_per_s
        FROM requests
        WHERE outcome = 'ok'
        GROUP BY COALESCE(workload_class, 'unclassified'), COALESCE(spec_method, 'off')
        """
    )
    op.execute(
        f"""
        CREATE VIEW v_route_performance AS
        SELECT backend,
               COALESCE(spec_method, 'off') AS spec_method,
               spec_controller,
               COUNT(*) AS requests,
               AVG(tokens_per_s) AS mean_tokens_per_s,
               AVG(ttft_ms) AS mean_ttft_ms,
               AVG(tpot_ms) AS mean_tpot_ms,
               {pct(0.5, "ttft_ms")} AS p50_ttft_ms,
               {pct(0.95, "ttft_ms")} AS p95_ttft_ms,
               {pct(0.5, "tpot_ms")} AS p50_tpot_ms,
               {pct(0.95, "tpot_ms")} AS p95_tpot_ms,
               AVG(CASE WHEN {drafts} > 0 THEN mean_acceptance_length END) AS mean_acceptance_length
        FROM requests
        WHERE outcome = 'ok'
        GROUP BY backend, COALESCE(spec_method, 'off'), spec_controller
        """
    )
    op.execute(
        f"""
        CREATE VIEW v_recent_errors AS
        SELECT received_at, request_id{errors_extra}, model, backend, endpoint, status, error_code, outcome
        FROM requests
        WHERE outcome = 'error'
        ORDER BY received_at DESC
        """
    )
