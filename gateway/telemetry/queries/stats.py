"""Aggregates over a time window, in the shape of the analysis views (v_acceptance_by_class,
v_route_performance, v_recent_errors), which cover all time and so cannot take a window."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import Engine, Float, and_, case, cast, func, select

from specgate.gateway.telemetry.tables import requests

r = requests.c


def _rows(engine: Engine, query: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        out = []
        for row in conn.execute(query).mappings():
            item = dict(row)
            for key, value in item.items():
                if isinstance(value, float):
                    item[key] = round(value, 4)
                elif isinstance(value, dt.datetime):
                    item[key] = value.isoformat()
            out.append(item)
        return out


def window_stats(engine: Engine, since: dt.datetime, limit_errors: int = 20) -> dict[str, Any]:
    in_window = r.arrival_time >= since
    ok = and_(in_window, r.outcome == "ok")
    klass = func.coalesce(r.workload_class, "unclassified").label("workload_class")
    method = func.coalesce(r.spec_method, "off").label("spec_method")
    drafted = func.sum(r.num_draft_tokens)
    mean_tps = func.avg(r.tokens_per_s).label("mean_tokens_per_s")
    spec_only = case((r.num_drafts > 0, r.mean_acceptance_length))
    # Of the prompt tokens of requests whose backend reports prefix-cache hits, the share it served
    # from its cache (rows without a report count on neither side).
    reported_prompt = func.sum(case((r.cached_tokens.is_not(None), r.prompt_tokens)))
    cached_share = (cast(func.sum(r.cached_tokens), Float) / func.nullif(reported_prompt, 0)).label(
        "cached_token_share"
    )
    totals = select(
        func.count().label("requests"),
        func.sum(case((r.outcome == "ok", 1), else_=0)).label("ok"),
        func.sum(case((r.outcome == "error", 1), else_=0)).label("errors"),
        func.sum(case((r.outcome == "cancelled", 1), else_=0)).label("cancelled"),
        func.sum(r.prompt_tokens).label("prompt_tokens"),
        func.sum(r.completion_tokens).label("completion_tokens"),
        func.sum(r.cached_tokens).label("cached_tokens"),
        cached_share,
        func.avg(r.tokens_per_s).label("mean_tokens_per_s"),
        func.avg(r.ttft_ms).label("mean_ttft_ms"),
        func.avg(r.tpot_ms).label("mean_tpot_ms"),
    ).where(in_window)
    by_class = (
        select(
            klass,
            method,
            func.count().label("requests"),
            func.sum(r.num_draft_tokens).label("draft_tokens"),
            func.sum(r.num_accepted_tokens).label("accepted_tokens"),
            (cast(func.sum(r.num_accepted_tokens), Float) / func.nullif(drafted, 0)).label("acceptance_rate"),
            func.avg(spec_only).label("mean_acceptance_length"),
            func.avg(r.tokens_per_s).label("mean_tokens_per_s"),
        )
        .where(ok)
        .group_by(klass, method)
        .order_by(klass, method)
    )
    by_route = (
        select(
            r.backend,
            method,
            r.spec_controller,
            func.count().label("requests"),
            func.avg(r.tokens_per_s).label("mean_tokens_per_s"),
            func.avg(r.ttft_ms).label("mean_ttft_ms"),
            func.avg(r.tpot_ms).label("mean_tpot_ms"),
            func.avg(spec_only).label("mean_acceptance_length"),
            cached_share,
        )
        .where(ok)
        .group_by(r.backend, method, r.spec_controller)
        .order_by(r.backend, method)
    )
    by_policy = (
        select(r.policy, r.policy_version, func.count().label("requests"), mean_tps)
        .where(in_window)
        .group_by(r.policy, r.policy_version)
        .order_by(r.policy_version)
    )
    errors = (
        select(r.arrival_time, r.request_id, r.model, r.backend, r.endpoint, r.status, r.error_code)
        .where(in_window, r.outcome == "error")
        .order_by(r.arrival_time.desc())
        .limit(limit_errors)
    )
    return {
        "since": since.isoformat(),
        "totals": _rows(engine, totals)[0],
        "acceptance_by_class": _rows(engine, by_class),
        "route_performance": _rows(engine, by_route),
        "by_policy_version": _rows(engine, by_policy),
        "recent_errors": _rows(engine, errors),
    }
