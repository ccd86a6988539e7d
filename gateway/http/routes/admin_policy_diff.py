"""/admin/policy/diff: two policy versions side by side, and every rule, prior or modelled arm that
differs between them (the dashboard's Policy page)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query

from specgate.gateway.http.deps import AdminDep, ServicesDep
from specgate.gateway.policy.diff import diff
from specgate.gateway.protocol.dashboard_schemas import PolicyDiff
from specgate.gateway.protocol.errors import GatewayError

router = APIRouter(prefix="/admin/policy", tags=["admin"])

VersionQ = Annotated[int, Query(ge=1, le=2**31 - 1, description="a policy version number")]


@router.get(
    "/diff", summary="Compare two policy versions: rules, priors, modelled arms", response_model=PolicyDiff
)
async def policy_diff(svc: ServicesDep, _: AdminDep, a: VersionQ, b: VersionQ) -> dict[str, Any]:
    manager = svc.policy
    if manager is None:
        raise GatewayError(
            409,
            "the routing policy is disabled on this gateway (policy.enabled=false)",
            code="policy_disabled",
        )
    rows = await asyncio.gather(
        asyncio.to_thread(manager.store.get, a), asyncio.to_thread(manager.store.get, b)
    )
    for number, row in zip((a, b), rows, strict=True):
        if row is None:
            raise GatewayError(404, f"policy version {number} does not exist", code="version_not_found")
    return diff(rows[0], rows[1])  # type: ignore[arg-type]
