"""Plain ASGI middleware (no BaseHTTPMiddleware: it buffers and hides disconnects).

Gives every request an id (the client's `x-request-id` if sane, else a fresh one) and returns it on
every response, refuses bodies over the size limit with 413, and turns any exception that escapes
the app before the response started into an OpenAI-shaped 500.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError

logger = logging.getLogger("specgate.gateway")
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"Request body too large: the limit is {limit} bytes.", code="request_too_large"
        )


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _SANE_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["received_at"] = time.time()
        state["received_perf"] = time.perf_counter()
        rid_header = (b"x-request-id", request_id.encode())
        started = False
        too_large = False  # set by the body reader; whatever the app answers then becomes a 413
        limit = self.max_body_bytes

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if too_large and not started:
                started = True
                await self._send_error(BodyTooLarge(limit), send_with_id_raw)
                return
            if too_large:
                return  # the app's own answer (a body-parse error) is replaced by the 413 above
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        async def send_with_id_raw(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        seen = 0

        async def limited_receive() -> Message:
            # Bodies without a content-length are counted as they arrive.
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    too_large = True
                    state["recorded"] = True  # the 413 is recorded here, not by the app's error handler
                    raise BodyTooLarge(limit)
            return message

        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._send_error(BodyTooLarge(limit), send_with_id)
            self._record_413(scope, request_id, state["received_at"])
            return
        try:
            await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            error = (
                exc
                if isinstance(exc, APIError)
                else APIError(500, "internal server error", code="internal_error")
            )
            if not isinstance(exc, APIError):
                logger.exception("unhandled error on %s", scope.get("path"))
            await self._send_error(error, send_with_id)
        if too_large:
            self._record_413(scope, request_id, state["received_at"])

    @staticmethod
    def _record_413(scope: Scope, request_id: str, received_at: float) -> None:
        app = scope.get("app")
        services = getattr(getattr(app, "state", None), "services", None)
        if services is not None:
            services.record_rejection(request_id, scope["path"], None, received_at, 413, "request_too_large")

    @staticmethod
    async def _send_error(error: APIError, send: Any) -> None:
        response = error.response()
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers}
        )
        await send({"type": "http.response.body", "body": response.body})
