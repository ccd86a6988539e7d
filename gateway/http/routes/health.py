"""/healthz (the process is alive), /readyz (models loaded, backends and store reachable), /metrics.

/readyz tells anyone whether the gateway is ready (its status code and `status`); what each check
found (backend names and states, the store's spool path) only the admin key or a dashboard session
sees.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from specgate.gateway.http.deps import AdminViewDep, ServicesDep
from specgate.gateway.http.responses import SafeJSONResponse

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(svc: ServicesDep, admin: AdminViewDep) -> JSONResponse:
    backends = svc.registry.status()
    checks: dict[str, Any] = {}
    embedded = svc.registry.embedded
    if embedded is not None:
        checks["embedded_model"] = {"ok": embedded.healthy, **embedded.status()}
    models = svc.registry.models()
    serving = {m: any(backends[b]["healthy"] for b in names) for m, names in models.items()}
    checks["models"] = {"ok": bool(serving) and any(serving.values()), "serving": serving}
    for name, check in svc.readiness.items():
        ok, detail = await check()
        checks[name] = {"ok": ok, "detail": detail}
    ready = all(c["ok"] for c in checks.values())
    body: dict[str, Any] = {"status": "ready" if ready else "not_ready"}
    if admin:
        body.update(checks=checks, backends=backends)
    return SafeJSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(svc: ServicesDep) -> Response:
    svc.refresh_gauges()
    return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
