"""/admin/timeseries/*: the dashboard's charts as JSON, over a window ending now, one point per step.

Any client with the admin key (or a dashboard session) may read them; the queries run in a worker
thread, so a slow database never holds up the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query

from specgate.gateway.http.deps import AdminDep, ServicesDep
from specgate.gateway.protocol.dashboard_schemas import SpeculationSeries, TrafficSeries
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.services import Services
from specgate.gateway.telemetry.queries.series_window import MAX_POINTS, Grid
from specgate.gateway.telemetry.queries.spec_series import speculation
from specgate.gateway.telemetry.queries.traffic_series import choices, traffic

router = APIRouter(prefix="/admin/timeseries", tags=["admin"])

MAX_WINDOW = 31 * 86400.0

WindowQ = Annotated[float, Query(gt=0, le=MAX_WINDOW, description="seconds back from now (at most 31 days)")]
StepQ = Annotated[
    float,
    Query(ge=1, le=86400, description=f"seconds per point; window / step may give at most {MAX_POINTS}"),
]
ModelQ = Annotated[str | None, Query(min_length=1, max_length=256, description="only this model")]
BackendQ = Annotated[str | None, Query(min_length=1, max_length=256, description="only this backend")]


def _grid(window: float, step: float) -> Grid:
    try:
        return Grid.ending_now(window, step)
    except ValueError as exc:
        raise GatewayError(
            422, f"invalid value for step: {exc}", param="query.step", code="invalid_value"
        ) from exc


def _engine(svc: Services) -> Any:
    if svc.store is None:
        raise GatewayError(409, "telemetry is disabled on this gateway", code="no_telemetry")
    return svc.store.engine


async def _series(svc: Services, fn: Any, grid: Grid, model: str | None, backend: str | None) -> dict:
    engine = _engine(svc)

    def run() -> dict[str, Any]:
        out = fn(engine, grid, model, backend)
        window = {"start": grid.start, "end": grid.end, "step": grid.step, "model": model, "backend": backend}
        out["window"] = {**window, **choices(engine, grid)}
        return dict(out)

    return await asyncio.to_thread(run)


@router.get(
    "/traffic",
    summary="Request rate, errors by code, TTFT / TPOT percentiles and tokens/s per step",
    response_model=TrafficSeries,
)
async def traffic_series(
    svc: ServicesDep,
    _: AdminDep,
    window: WindowQ = 3600.0,
    step: StepQ = 60.0,
    model: ModelQ = None,
    backend: BackendQ = None,
) -> dict[str, Any]:
    return await _series(svc, traffic, _grid(window, step), model, backend)


@router.get(
    "/speculation",
    summary="Acceptance, route mix, speed-up per class and speculation by load, per step",
    response_model=SpeculationSeries,
)
async def speculation_series(
    svc: ServicesDep,
    _: AdminDep,
    window: WindowQ = 3600.0,
    step: StepQ = 60.0,
    model: ModelQ = None,
    backend: BackendQ = None,
) -> dict[str, Any]:
    return await _series(svc, speculation, _grid(window, step), model, backend)
