"""GET /v1/models and /v1/models/{id}: every model any backend serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from specgate.gateway.http.deps import ApiKeyDep, ServicesDep
from specgate.gateway.protocol.errors import GatewayError

router = APIRouter()


def _card(model: str, backends: list[str], created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "specgate", "backends": backends}


@router.get("/v1/models")
async def list_models(svc: ServicesDep, key: ApiKeyDep) -> dict[str, Any]:
    created = svc.created
    return {"object": "list", "data": [_card(m, b, created) for m, b in svc.registry.models().items()]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, svc: ServicesDep, key: ApiKeyDep) -> dict[str, Any]:
    backends = svc.registry.models().get(model)
    if backends is None:
        raise GatewayError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
    return _card(model, backends, svc.created)
