"""POST /v1/chat/completions and POST /v1/completions: one path, two request shapes, raw ASGI.

These two routes are the gateway's hot path, so they skip FastAPI's middleware stack, router and
dependency injection (a third of the gateway's CPU per proxied request, measured with py-spy): the
app hands them straight to `GatewayMiddleware` (request id, tracker, limits) and this handler. The
checks are the same functions the FastAPI routes use: the key and rate limit (`deps.api_key`),
then the body (`body.parse`), read only after the key check, so an unauthenticated client never
gets a 4 MiB JSON document parsed. Their OpenAPI operations are added by `openapi.install`.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from specgate.gateway.backends.base import Kind
from specgate.gateway.http import body
from specgate.gateway.http.deps import api_key, hold_stream
from specgate.gateway.http.errors import post_only
from specgate.gateway.http.serving import handle
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.request.tracker import RequestTracker
from specgate.gateway.services import Services


@dataclass(frozen=True, slots=True)
class Operation:
    path: str
    kind: Kind
    model: type[ChatCompletionRequest] | type[CompletionRequest]
    summary: str

    @property
    def operation_id(self) -> str:  # as FastAPI would name it, so clients see no change
        return f"{self.summary.lower().replace(' ', '_')}{self.path.replace('/', '_')}_post"


OPERATIONS = (
    Operation("/v1/chat/completions", "chat", ChatCompletionRequest, "Chat Completions"),
    Operation("/v1/completions", "completion", CompletionRequest, "Completions"),
)


def endpoint(op: Operation) -> ASGIApp:
    """The ASGI app of one inference route (inside GatewayMiddleware, which catches what it raises)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        refusal = post_only(scope["method"])
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        request = Request(scope, receive)
        svc: Services = scope["app"].state.services
        tracker: RequestTracker = request.state.tracker  # made by GatewayMiddleware
        caller = await api_key(request, svc, tracker)
        parsed = await body.parse(request, op.model, tracker)
        if parsed.stream:
            hold_stream(request, svc, caller)
        response = await handle(svc, request, tracker, parsed, op.kind)
        await response(scope, receive, send)

    return app
