"""Traffic over time, for the dashboard and `/admin/timeseries/traffic`: request rate, outcomes,
errors by code, TTFT / TPOT percentiles and output tokens per second, per step of a window,
optionally for one model and / or backend; and the same figures per (model, backend) over the
whole window. Plain SQL on `requests`, grouped by the database, on SQLite and PostgreSQL alike."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, String, and_, case, cast, func, select

from specgate.gateway.telemetry.queries.quantiles import bin_of, quantiles
from specgate.gateway.telemetry.queries.series_window import Grid, bucket_of
from specgate.gateway.telemetry.tables import requests

r = requests.c
QS = (0.5, 0.9, 0.99)
LATENCIES = ("ttft_ms", "tpot_ms")


def window_filter(grid: Grid, model: str | None, backend: str | None) -> Any:
    """Rows that arrived inside the grid, of one model / backend when given."""
    cond = [r.arrival_time >= grid.since(), r.arrival_time < grid.until()]
    if model is not None:
        cond.append(r.model == model)
    if backend is not None:
        cond.append(r.backend == backend)
    return and_(*cond)


def _ok(value: Any) -> Any:
    return case((r.outcome == "ok", value))


def _latency_histograms(
    engine: Engine, where: Any, keys: list[Any]
) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    """Per latency column and group key: its bins' counts, and its exact min and max."""
    out: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    with engine.connect() as conn:
        for name in LATENCIES:
            col = r[name]
            groups: dict[tuple[Any, ...], dict[str, Any]] = defaultdict(lambda: {"bins": []})
            cond = and_(where, r.outcome == "ok", col.is_not(None), col >= 0)
            b = bin_of(col).label("bin")
            hist = select(*keys, b, func.count().label("n")).where(cond).group_by(*keys, b)
            for row in conn.execute(hist):
                groups[tuple(row[: len(keys)])]["bins"].append((row.bin, row.n))
            span = select(*keys, func.min(col), func.max(col)).where(cond).group_by(*keys)
            for row in conn.execute(span):
                groups[tuple(row[: len(keys)])].update(lo=row[-2], hi=row[-1])
            out[name] = groups
    return out


def _percentiles(hists: dict[str, dict[tuple[Any, ...], dict[str, Any]]], key: tuple[Any, ...]) -> dict:
    out = {}
    for name in LATENCIES:
        g = hists[name].get(key)
        out[name] = (
            quantiles(g["bins"], QS, g.get("lo"), g.get("hi"))
            if g
            else {f"p{round(q * 100)}": None for q in QS}
        )
    return out


def traffic(engine: Engine, grid: Grid, model: str | None = None, backend: str | None = None) -> dict:
    where = window_filter(grid, model, backend)
    bucket = bucket_of(engine, grid).label("bucket")
    code = func.coalesce(r.error_code, cast(r.status, String)).label("code")
    counts = (
        select(
            bucket,
            func.count().label("requests"),
            func.sum(case((r.outcome == "ok", 1), else_=0)).label("ok"),
            func.sum(case((r.outcome == "error", 1), else_=0)).label("errors"),
            func.sum(case((r.outcome == "cancelled", 1), else_=0)).label("cancelled"),
            func.sum(_ok(r.completion_tokens)).label("completion_tokens"),
            func.sum(_ok(r.prompt_tokens)).label("prompt_tokens"),
            func.avg(_ok(r.tokens_per_s)).label("mean_request_tokens_per_s"),
        )
        .where(where)
        .group_by(bucket)
    )
    errors = (
        select(bucket, code, func.count().label("n"))
        .where(where, r.outcome == "error")
        .group_by(bucket, code)
    )
    with engine.connect() as conn:
        by_bucket = {row.bucket: row for row in conn.execute(counts)}
        error_rows = list(conn.execute(errors))
    hists = _latency_histograms(engine, where, [bucket])
    codes: dict[int, dict[str, int]] = defaultdict(dict)
    for err in error_rows:
        codes[err.bucket][str(err.code)] = int(err.n)
    points = []
    for i, t in enumerate(grid.times()):
        row: Any = by_bucket.get(i)
        n = int(row.requests) if row else 0
        tokens = int(row.completion_tokens or 0) if row else 0
        points.append(
            {
                "t": t,
                "requests": n,
                "requests_per_s": n / grid.step,
                "ok": int(row.ok or 0) if row else 0,
                "errors": int(row.errors or 0) if row else 0,
                "cancelled": int(row.cancelled or 0) if row else 0,
                "errors_by_code": codes.get(i, {}),
                "completion_tokens": tokens,
                "prompt_tokens": int(row.prompt_tokens or 0) if row else 0,
                "tokens_per_s": tokens / grid.step,
                "mean_request_tokens_per_s": _round(row.mean_request_tokens_per_s) if row else None,
                **_percentiles(hists, (i,)),
            }
        )
    return {"points": points, "by_route": by_route(engine, grid, model, backend)}


def by_route(engine: Engine, grid: Grid, model: str | None, backend: str | None) -> list[dict[str, Any]]:
    """Per (model, backend) over the whole window: volume, errors, throughput, latency."""
    where = window_filter(grid, model, backend)
    keys = [r.model, r.backend]
    query = (
        select(
            *keys,
            func.count().label("requests"),
            func.sum(case((r.outcome == "error", 1), else_=0)).label("errors"),
            func.sum(_ok(r.completion_tokens)).label("completion_tokens"),
            func.avg(_ok(r.tokens_per_s)).label("mean_request_tokens_per_s"),
        )
        .where(where)
        .group_by(*keys)
        .order_by(func.count().desc(), r.model, r.backend)
    )
    with engine.connect() as conn:
        rows = list(conn.execute(query))
    hists = _latency_histograms(engine, where, keys)
    window = grid.points * grid.step
    return [
        {
            "model": row.model,
            "backend": row.backend,
            "requests": int(row.requests),
            "requests_per_s": row.requests / window,
            "errors": int(row.errors or 0),
            "error_rate": (row.errors or 0) / row.requests,
            "tokens_per_s": (row.completion_tokens or 0) / window,
            "mean_request_tokens_per_s": _round(row.mean_request_tokens_per_s),
            **_percentiles(hists, (row.model, row.backend)),
        }
        for row in rows
    ]


def _round(value: Any) -> float | None:
    return None if value is None else round(float(value), 4)


def choices(engine: Engine, grid: Grid) -> dict[str, list[str]]:
    """The models and backends seen in the window (what a filter may pick)."""
    where = window_filter(grid, None, None)
    with engine.connect() as conn:
        models = conn.execute(select(r.model).where(where).distinct().order_by(r.model)).scalars()
        out = {"models": [m for m in models if m is not None]}
        backends = conn.execute(
            select(r.backend).where(where, r.backend.is_not(None)).distinct().order_by(r.backend)
        ).scalars()
        out["backends"] = list(backends)
    return out
