"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.deps import ApiKeyDep, ServicesDep
from gateway.schemas import CompletionRequest
from gateway.serving import handle

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, svc: ServicesDep, key: ApiKeyDep
) -> Response:
    return await handle(svc, request, body, "completion", key)
