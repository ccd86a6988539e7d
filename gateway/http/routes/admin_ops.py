"""/admin/route/explain, /admin/stats, /admin/backends: what the gateway would do and what it did."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from specgate.gateway.http.body import parse_admin
from specgate.gateway.http.deps import AdminDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from specgate.gateway.services import Services
from specgate.gateway.telemetry.queries.stats import window_stats
from specgate.policies.load import Load

router = APIRouter(prefix="/admin", tags=["admin"])


@router.post(
    "/route/explain",
    summary="Dry run: how a chat request would be classified and routed",
    openapi_extra=json_body(ChatCompletionRequest),
)
async def explain(request: Request, svc: ServicesDep, _: AdminDep) -> dict[str, Any]:
    body = await parse_admin(request, ChatCompletionRequest)
    plan = svc.router.plan(body, svc.load_signals(), explore=False)  # no exploration draw, no budget spent
    return plan.explain()


@router.get("/stats", summary="Request, acceptance and route aggregates over a time window")
async def stats(
    svc: ServicesDep,
    _: AdminDep,
    window: Annotated[float, Query(gt=0, le=24 * 365, description="hours back from now")] = 24.0,
) -> dict[str, Any]:
    if svc.store is None:
        raise GatewayError(409, "telemetry is disabled on this gateway", code="no_telemetry")
    since = dt.datetime.now(dt.UTC) - dt.timedelta(hours=window)
    out = await asyncio.to_thread(window_stats, svc.store.engine, since)
    out["window_hours"] = window
    return out


@router.get("/backends", summary="Every backend: health, breaker, load and its source, speculation, models")
async def backends(svc: ServicesDep, _: AdminDep) -> dict[str, Any]:
    load = svc.load_signals()
    status = svc.registry.status()
    reg = svc.registry
    return {
        "backends": [
            {"name": name, "models": _models(svc, name), **info, "policy_load": _backend_load(load, name)}
            for name, info in status.items()
        ],
        # A replica group is one routing arm: its load is the mean over its healthy replicas.
        "groups": [
            {
                "name": group,
                "members": members,
                "speculation": reg.pool_speculation(group),
                "policy_load": _backend_load(load, group),
            }
            for group, members in reg.groups.items()
        ],
        "engine_load": load.engine_features(),
    }


def _models(svc: Services, name: str) -> list[str]:
    """The models a backend serves (an external backend's status lists them too, and wins)."""
    backend = svc.registry.get(name)
    return [] if backend is None else list(backend.model_ids())


def _backend_load(load: Load, name: str) -> dict[str, Any] | None:
    b = load.backends.get(name)
    if b is None:
        return None
    return {
        "in_flight": b.in_flight,
        "latency_ewma_ms": b.latency_ewma_ms,
        "healthy": b.healthy,
        "running": b.num_running,
        "waiting": b.num_waiting,
        "kv_usage": b.kv_cache_usage,
        "batch": b.batch,
        "speculative": b.speculative,
        "acceptance_length": b.acceptance_length,
        "features": b.features() if b.external else None,
    }
