"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.gateway.http import body
from specgate.gateway.http.deps import ApiKeyDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.serving import handle
from specgate.gateway.protocol.schemas import ChatCompletionRequest

router = APIRouter()


# The body is read after the key check (the dependencies), not by FastAPI before it: an
# unauthenticated client never gets a 4 MiB JSON document parsed.
@router.post("/v1/chat/completions", response_model=None, openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request, svc: ServicesDep, key: ApiKeyDep) -> Response:
    parsed = await body.parse(request, ChatCompletionRequest)
    return await handle(svc, request, parsed, "chat", key)
