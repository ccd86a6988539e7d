"""Speculation over time, for the dashboard and `/admin/timeseries/speculation`: drafted and
accepted tokens, acceptance rate and mean accepted length per step; the route mix (backend x method)
per step; per workload class x method the acceptance and the speed-up over plain requests of the
same class; and how often requests speculated by the load they arrived at, with the load at which
the policy turned speculation off."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, Float, and_, case, cast, func, select

from specgate.gateway.telemetry.queries.series_window import Grid, bucket_of
from specgate.gateway.telemetry.queries.traffic_series import window_filter
from specgate.gateway.telemetry.tables import requests

r = requests.c
PLAIN = "off"
UPSTREAM = "upstream"  # an external backend's rows: it decides its own speculation
# The reason the policies' guard records when a large batch turns speculation off
# (specgate.policies.guards.safe_arms); tests keep the two in step.
LOAD_OFF_MARK = "%: speculation off%"
LOAD_EDGES = (1, 2, 4, 8, 16, 32, 64)  # sequences running + waiting at arrival: 0, 1, 2-3, 4-7, ...


def _method() -> Any:
    return func.coalesce(r.spec_method, UPSTREAM)


def _rate(accepted: Any, drafted: Any) -> float | None:
    return round(accepted / drafted, 6) if drafted else None


def _num(value: Any, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def speculation(engine: Engine, grid: Grid, model: str | None = None, backend: str | None = None) -> dict:
    where = and_(window_filter(grid, model, backend), r.outcome == "ok")
    bucket = bucket_of(engine, grid).label("bucket")
    method = _method().label("method")
    spec_only = case((r.num_drafts > 0, r.mean_acceptance_length))
    per_step = select(
        bucket,
        func.sum(r.num_draft_tokens).label("drafted"),
        func.sum(r.num_accepted_tokens).label("accepted"),
        func.avg(spec_only).label("mean_acceptance_length"),
    ).group_by(bucket)
    mix = select(bucket, r.backend, method, func.count().label("n")).group_by(bucket, r.backend, method)
    with engine.connect() as conn:
        steps = {row.bucket: row for row in conn.execute(per_step.where(where))}
        arms: dict[int, dict[str, int]] = defaultdict(dict)
        for arm in conn.execute(mix.where(where)):
            arms[arm.bucket][f"{arm.backend or 'none'}:{arm.method}"] = int(arm.n)
    points = []
    for i, t in enumerate(grid.times()):
        row: Any = steps.get(i)
        drafted = int(row.drafted or 0) if row else 0
        accepted = int(row.accepted or 0) if row else 0
        points.append(
            {
                "t": t,
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_rate": _rate(accepted, drafted),
                "mean_acceptance_length": _num(row.mean_acceptance_length) if row else None,
                "route_mix": arms.get(i, {}),
            }
        )
    return {
        "points": points,
        "by_class": by_class(engine, where),
        "by_load": by_load(engine, where),
    }


def by_class(engine: Engine, where: Any) -> list[dict[str, Any]]:
    """Per workload class x method: acceptance, and goodput against plain requests of that class."""
    klass = func.coalesce(r.workload_class, "unclassified").label("workload_class")
    method = _method().label("method")
    spec_only = case((r.num_drafts > 0, r.mean_acceptance_length))
    query = (
        select(
            klass,
            method,
            func.count().label("requests"),
            func.sum(r.num_draft_tokens).label("drafted"),
            func.sum(r.num_accepted_tokens).label("accepted"),
            func.avg(spec_only).label("mean_acceptance_length"),
            func.avg(r.tokens_per_s).label("mean_tokens_per_s"),
        )
        .where(where)
        .group_by(klass, method)
        .order_by(klass, method)
    )
    with engine.connect() as conn:
        rows = list(conn.execute(query))
    plain = {row.workload_class: row.mean_tokens_per_s for row in rows if row.method == PLAIN}
    out = []
    for row in rows:
        base = plain.get(row.workload_class)
        speculative = row.method not in (PLAIN, UPSTREAM)
        speedup = row.mean_tokens_per_s / base if speculative and base and row.mean_tokens_per_s else None
        out.append(
            {
                "workload_class": row.workload_class,
                "method": row.method,
                "requests": int(row.requests),
                "draft_tokens": int(row.drafted or 0),
                "accepted_tokens": int(row.accepted or 0),
                "acceptance_rate": _rate(int(row.accepted or 0), int(row.drafted or 0)),
                "mean_acceptance_length": _num(row.mean_acceptance_length),
                "mean_tokens_per_s": _num(row.mean_tokens_per_s),
                "speedup_vs_plain": _num(speedup),
            }
        )
    return out


def by_load(engine: Engine, where: Any) -> dict[str, Any]:
    """Requests by the batch they met (running + waiting at arrival, embedded engine rows): how many
    speculated, how many the policy turned off for the load, and the least load it did that at."""
    batch = func.coalesce(r.load_running, 0) + func.coalesce(r.load_queue_depth, 0)
    band = case(*((batch < edge, i) for i, edge in enumerate(LOAD_EDGES)), else_=len(LOAD_EDGES)).label(
        "band"
    )
    speculating = and_(r.spec_method.is_not(None), r.spec_method != PLAIN)
    load_off = r.decision_reason.like(LOAD_OFF_MARK)
    embedded = and_(where, r.load_running.is_not(None))
    query = (
        select(
            band,
            func.count().label("requests"),
            func.sum(case((speculating, 1), else_=0)).label("speculating"),
            func.sum(case((load_off, 1), else_=0)).label("off_for_load"),
            cast(func.avg(batch), Float).label("mean_batch"),
        )
        .where(embedded)
        .group_by(band)
        .order_by(band)
    )
    first_off = select(func.min(batch)).where(embedded, load_off)
    with engine.connect() as conn:
        rows = list(conn.execute(query))
        least = conn.execute(first_off).scalar()
    bands = []
    for row in rows:
        lo = 0 if row.band == 0 else LOAD_EDGES[row.band - 1]
        hi = LOAD_EDGES[row.band] - 1 if row.band < len(LOAD_EDGES) else None
        bands.append(
            {
                "batch_min": lo,
                "batch_max": hi,
                "requests": int(row.requests),
                "speculating": int(row.speculating or 0),
                "speculating_share": round((row.speculating or 0) / row.requests, 6),
                "off_for_load": int(row.off_for_load or 0),
            }
        )
    return {"bands": bands, "turned_off_at_batch": None if least is None else int(least)}
