"""POST /v1/chat/completions and POST /v1/completions: one path, two request shapes.

The body is read after the key check (the dependencies), not by FastAPI before it: an
unauthenticated client never gets a 4 MiB JSON document parsed.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.gateway.http import body
from specgate.gateway.http.deps import ApiKeyDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.serving import handle
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request, svc: ServicesDep, key: ApiKeyDep) -> Response:
    return await handle(svc, request, await body.parse(request, ChatCompletionRequest), "chat", key)


@router.post("/v1/completions", response_model=None, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request, svc: ServicesDep, key: ApiKeyDep) -> Response:
    return await handle(svc, request, await body.parse(request, CompletionRequest), "completion", key)
