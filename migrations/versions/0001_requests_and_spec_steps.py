"""requests and spec_steps tables, their indexes, and the analysis views

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

VIEWS = ("v_acceptance_by_class", "v_route_performance", "v_recent_errors")


def upgrade() -> None:
    op.create_table(
        "requests",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("api_key_id", sa.String(32)),
        sa.Column("endpoint", sa.String(16), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_token_at", sa.DateTime(timezone=True)),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("cancelled", sa.Boolean(), nullable=False),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("error_code", sa.String(64)),
        sa.Column("prompt_tokens", sa.Integer()),
        sa.Column("completion_tokens", sa.Integer()),
        sa.Column("queue_ms", sa.Float()),
        sa.Column("ttft_ms", sa.Float()),
        sa.Column("tpot_ms", sa.Float()),
        sa.Column("e2e_ms", sa.Float()),
        sa.Column("tokens_per_s", sa.Float()),
        sa.Column("overhead_ms", sa.Float()),
        sa.Column("attempts", sa.Integer()),
        sa.Column("backend", sa.String(128)),
        sa.Column("spec_method", sa.String(64)),
        sa.Column("spec_controller", sa.String(32)),
        sa.Column("k_min", sa.Integer()),
        sa.Column("k_max", sa.Integer()),
        sa.Column("policy", sa.String(64)),
        sa.Column("policy_version", sa.String(64)),
        sa.Column("decision_reason", sa.Text()),
        sa.Column("route", sa.JSON()),
        sa.Column("workload_class", sa.String(32)),
        sa.Column("class_confidence", sa.Float()),
        sa.Column("features", sa.JSON()),
        sa.Column("load_queue_depth", sa.Integer()),
        sa.Column("load_running", sa.Integer()),
        sa.Column("load_kv_usage", sa.Float()),
        sa.Column("load_backend_in_flight", sa.Integer()),
        sa.Column("num_spec_steps", sa.Integer()),
        sa.Column("num_draft_tokens", sa.Integer()),
        sa.Column("num_accepted_draft_tokens", sa.Integer()),
        sa.Column("mean_acceptance_length", sa.Float()),
        sa.Column("draft_acceptance_rate", sa.Float()),
        sa.Column("acceptance_histogram", sa.JSON()),
        sa.Column("upstream", sa.JSON()),
        sa.PrimaryKeyConstraint("request_id", name="pk_requests"),
    )
    op.create_index("ix_requests_received_at", "requests", ["received_at"])
    op.create_index("ix_requests_model_received_at", "requests", ["model", "received_at"])
    op.create_index("ix_requests_workload_class_spec_method", "requests", ["workload_class", "spec_method"])
    op.create_index(
        "ix_requests_backend_spec_method_received_at", "requests", ["backend", "spec_method", "received_at"]
    )
    op.create_index("ix_requests_outcome_received_at", "requests", ["outcome", "received_at"])
    op.create_table(
        "spec_steps",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("k_proposed", sa.Integer(), nullable=False),
        sa.Column("accepted", sa.Integer(), nullable=False),
        sa.Column("batch_tokens", sa.Integer()),
        sa.Column("step_ms", sa.Float()),
        sa.PrimaryKeyConstraint("id", name="pk_spec_steps"),
        sa.UniqueConstraint("request_id", "step_index", name="uq_spec_steps_request_id_step_index"),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    for sql in _views(postgres):
        op.execute(sql)


def downgrade() -> None:
    for name in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_table("spec_steps")
    for ix in (
        "ix_requests_outcome_received_at",
        "ix_requests_backend_spec_method_received_at",
        "ix_requests_workload_class_spec_method",
        "ix_requests_model_received_at",
        "ix_requests_received_at",
    ):
        op.drop_index(ix, table_name="requests")
    op.drop_table("requests")


def _views(postgres: bool) -> list[str]:
    def pct(p: float, column: str) -> str:
        # SQLite has no percentile aggregate; the column stays so queries run on both.
        if postgres:
            return f"percentile_cont({p}) WITHIN GROUP (ORDER BY {column})"
        return "NULL"

    return [
        """
        CREATE VIEW v_acceptance_by_class AS
        SELECT COALESCE(workload_class, 'unclassified') AS workload_class,
               COALESCE(spec_method, 'off') AS spec_method,
               COUNT(*) AS requests,
               SUM(num_draft_tokens) AS draft_tokens,
               SUM(num_accepted_draft_tokens) AS accepted_tokens,
               CAST(SUM(num_accepted_draft_tokens) AS FLOAT) / NULLIF(SUM(num_draft_tokens), 0)
                   AS acceptance_rate,
               AVG(CASE WHEN num_spec_steps > 0 THEN mean_acceptance_length END) AS mean_acceptance_length,
               AVG(tokens_per_s) AS mean_tokens_per_s
        FROM requests
        WHERE outcome = 'ok'
        GROUP BY COALESCE(workload_class, 'unclassified'), COALESCE(spec_method, 'off')
        """,
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
               AVG(CASE WHEN num_spec_steps > 0 THEN mean_acceptance_length END) AS mean_acceptance_length
        FROM requests
        WHERE outcome = 'ok'
        GROUP BY backend, COALESCE(spec_method, 'off'), spec_controller
        """,
        """
        CREATE VIEW v_recent_errors AS
        SELECT received_at, request_id, model, backend, endpoint, status, error_code, outcome
        FROM requests
        WHERE outcome = 'error'
        ORDER BY received_at DESC
        """,
    ]
