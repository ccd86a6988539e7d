"""/admin/policy: inspect, tune, retrain and roll back the routing policy (admin key required)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request

from specgate.gateway.http import body
from specgate.gateway.http.deps import AdminDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.protocol.admin_schemas import PolicyPatch, RetrainRequest
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.services import Services
from specgate.policies.rules import RuleConfig

router = APIRouter(prefix="/admin/policy", tags=["admin"])


def _manager(svc: Services) -> PolicyManager:
    if svc.policy is None:
        raise GatewayError(
            409,
            "the routing policy is disabled on this gateway (policy.enabled=false)",
            code="policy_disabled",
        )
    return svc.policy


@router.get("", summary="The active policy version, its rules and settings")
async def get_policy(svc: ServicesDep, _: AdminDep) -> dict[str, Any]:
    return _manager(svc).describe()


# Admin bodies are read after the admin key is checked (not by FastAPI before it), with the same
# bounds as /v1's: size, depth, finite numbers, valid Unicode.
@router.put(
    "",
    summary="Change rules (thresholds, per-class arms, K bounds, exploration): a new version",
    openapi_extra=json_body(PolicyPatch),
)
async def put_policy(request: Request, svc: ServicesDep, _: AdminDep) -> dict[str, Any]:
    patch = await body.parse_admin(request, PolicyPatch)
    manager = _manager(svc)
    try:
        rules = manager.state.rules.merged(patch.changes())
    except (TypeError, ValueError) as exc:
        raise GatewayError(422, f"invalid policy: {exc}", code="invalid_value") from exc
    unknown = _unknown_methods(svc, rules)
    if unknown:
        raise GatewayError(
            422, f"invalid policy: unknown speculation method(s) {', '.join(unknown)}", code="invalid_value"
        )
    version = await manager.update_rules(rules, patch.note)
    return {"version": version, "policy": manager.describe()}


def _unknown_methods(svc: Services, rules: RuleConfig) -> list[str]:
    """Methods a rule names that the policy may not choose on this gateway."""
    used = {r.method for r in rules.classes.values()} | {rules.uncertain.method}
    return sorted(used - {"off", *svc.settings.policy.methods})


@router.post(
    "/retrain",
    summary="Fit a policy from telemetry, evaluate it offline, promote it if better",
    openapi_extra=json_body(RetrainRequest, required=False),
)
async def retrain(request: Request, svc: ServicesDep, _: AdminDep) -> dict[str, Any]:
    req = await body.parse_admin(request, RetrainRequest, optional=True)
    return await _manager(svc).retrain(force=req.force, window_hours=req.window_hours)


@router.get("/versions", summary="Policy versions, newest first")
async def versions(
    svc: ServicesDep, _: AdminDep, limit: Annotated[int, Query(ge=1, le=1000)] = 50
) -> dict[str, Any]:
    manager = _manager(svc)
    return {"active_version": manager.version, "versions": manager.versions(limit)}


@router.post("/rollback/{version}", summary="Make an earlier version's rules and model active again")
async def rollback(
    version: Annotated[int, Path(ge=1, le=2**31 - 1)], svc: ServicesDep, _: AdminDep
) -> dict[str, Any]:
    manager = _manager(svc)
    row = await manager.rollback(version)
    return {"version": row, "policy": manager.describe()}
