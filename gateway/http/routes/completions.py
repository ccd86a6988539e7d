"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.gateway.http import body
from specgate.gateway.http.deps import ApiKeyDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.serving import handle
from specgate.gateway.protocol.schemas import CompletionRequest

router = APIRouter()


# As for chat: the key is checked before the body is read and parsed.
@router.post("/v1/completions", response_model=None, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, svc: ServicesDep, key: ApiKeyDep) -> Response:
    parsed = await body.parse(request, CompletionRequest)
    return await handle(svc, request, parsed, "completion", key)
