"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.deps import ApiKeyDep, ServicesDep
from gateway.schemas import ChatCompletionRequest
from gateway.serving import handle

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, svc: ServicesDep, key: ApiKeyDep
) -> Response:
    return await handle(svc, request, body, "chat", key)
