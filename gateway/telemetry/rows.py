"""A finished request's record as rows: plain JSON values, so the same dict goes to SQL or the spool."""

from __future__ import annotations

import datetime as dt
from typing import Any

from specgate.gateway.telemetry.records import RequestRecord

TIME_COLUMNS = ("received_at", "first_token_at", "finished_at")


def request_row(rec: RequestRecord) -> dict[str, Any]:
    route = rec.route.as_dict() if rec.route is not None else {}
    spec_route = route.get("spec") or {}
    spec = rec.spec or {}
    in_flight = rec.load.get("backend_in_flight") or {}
    affinity = route.get("affinity") or {}
    return {
        "request_id": rec.request_id,
        "client_request_id": rec.client_request_id,
        "api_key_id": rec.api_key_id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "stream": rec.stream,
        "received_at": rec.received_at,
        "first_token_at": rec.first_token_at,
        "finished_at": rec.finished_at,
        "status": rec.status,
        "outcome": rec.outcome,
        "cancelled": rec.cancelled,
        "finish_reason": rec.finish_reason,
        "error_code": rec.error_code,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "cached_tokens": rec.cached_tokens,
        "queue_ms": rec.queue_ms,
        "ttft_ms": rec.ttft_ms,
        "tpot_ms": rec.tpot_ms,
        "e2e_ms": rec.e2e_ms,
        "tokens_per_s": rec.tokens_per_s,
        "overhead_ms": rec.overhead_ms,
        "attempts": rec.attempts,
        "backend": rec.backend,
        # The method the request ran with (an external backend may report its own), else the route's.
        "spec_method": spec.get("method") or spec_route.get("method"),
        "spec_controller": spec_route.get("controller"),
        "k_min": spec_route.get("k_min"),
        "k_max": spec_route.get("k_max"),
        "policy": route.get("policy"),
        "policy_version": route.get("policy_version"),
        "decision_reason": route.get("reason"),
        "route": route or None,
        "workload_class": rec.workload_class,
        "class_confidence": rec.class_confidence,
        "features": rec.features or None,
        "load_queue_depth": rec.load.get("queue_depth"),
        "load_running": rec.load.get("running"),
        "load_kv_usage": rec.load.get("kv_usage"),
        "load_backend_in_flight": in_flight.get(rec.backend) if rec.backend else None,
        "num_drafts": spec.get("num_drafts"),
        "num_draft_tokens": spec.get("num_draft_tokens"),
        "num_accepted_tokens": spec.get("num_accepted_tokens"),
        "mean_acceptance_length": spec.get("mean_acceptance_length"),
        "draft_acceptance_rate": spec.get("draft_acceptance_rate"),
        "num_accepted_tokens_per_pos": spec.get("num_accepted_tokens_per_pos"),
        "num_tree_drafts": spec.get("num_tree_drafts"),
        "mean_draft_nodes": spec.get("mean_draft_nodes"),
        "propensity": route.get("propensity"),
        "affinity_group": affinity.get("group"),
        "affinity_source": affinity.get("source"),
        "affinity_hit": affinity.get("hit"),
        "upstream": rec.upstream or None,
    }


def step_rows(rec: RequestRecord) -> list[dict[str, Any]]:
    return [
        {
            "request_id": rec.request_id,
            "step_index": i,
            "k_proposed": k,
            "accepted": a,
            "batch_tokens": b,
            "step_ms": ms,
            "depth": depth,
        }
        for i, (k, a, b, ms, depth) in enumerate(rec.spec_steps)
    ]


# Rows spooled by earlier versions name some columns as they were before revision 0004.
LEGACY_COLUMNS = {
    "num_spec_steps": "num_drafts",
    "num_accepted_draft_tokens": "num_accepted_tokens",
    "acceptance_histogram": "num_accepted_tokens_per_pos",
}


def upgrade_row(row: dict[str, Any]) -> dict[str, Any]:
    """A spooled row under today's column names."""
    if not any(old in row for old in LEGACY_COLUMNS):
        return row
    return {LEGACY_COLUMNS.get(k, k): v for k, v in row.items()}


def to_sql(row: dict[str, Any]) -> dict[str, Any]:
    """Unix-second timestamps to timezone-aware datetimes."""
    out = dict(row)
    for col in TIME_COLUMNS:
        if out.get(col) is not None:
            out[col] = dt.datetime.fromtimestamp(out[col], tz=dt.UTC)
    return out
