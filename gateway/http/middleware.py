"""Plain ASGI middleware (no BaseHTTPMiddleware: it buffers and hides disconnects).

For every request: a gateway id (the client's `x-request-id` is echoed back and kept apart, never
used as a key), the client's address and scheme (X-Forwarded-For and X-Forwarded-Proto only from
trusted proxies), the body size limit (413), deadlines for the body (each read, and the whole of
it: 408, and the connection is closed), the per-address limit on refused traffic (401 / 413), and
an OpenAI-shaped 500 for anything that escapes the app before the response started. A client that
leaves before its body is in is a client disconnect (499), not an error of ours.

For the inference routes it also makes the request's context and its tracker before anything can
fail (`state.tracker`: the stages fill their parts of it), and when the request ends it has the
one record built from the status actually sent and submitted exactly once; and it releases the
in-flight slots the request still holds (`state.held`, deps.hold).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specgate.gateway.backends.base import Endpoint
from specgate.gateway.backends.relay import Relayed
from specgate.gateway.http.auth import (
    bearer,
    check_key,
    client_address,
    forwarded_scheme,
    limit_key,
    parse_networks,
)
from specgate.gateway.http.errors import error_response
from specgate.gateway.http.ui.dashboard_auth import dashboard_auth
from specgate.gateway.limits.limiters import release
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.request.context import RequestContext
from specgate.gateway.request.tracker import RequestTracker

logger = logging.getLogger("specgate.gateway")
_SANE_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
INFERENCE_PATHS: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
}
# Pass-through routes (routes/embeddings.py) that reach a backend: tracked, one row each, like the above.
RELAYED_PATHS: dict[str, Relayed] = {
    "/v1/embeddings": "embeddings",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
}
REFUSALS = (401, 413)  # answers that cost the sender's address a token of its refusal budget
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes are never turned away


class BodyTooLarge(GatewayError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"Request body too large: the limit is {limit} bytes.", code="request_too_large"
        )


class BodyTimeout(GatewayError):
    def __init__(self, what: str) -> None:
        super().__init__(408, f"The request body was not received in time ({what}).", code="request_timeout")


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        trusted_proxies: list[str] | None = None,
        body_read_timeout: float = 15.0,
        body_timeout: float = 60.0,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.trusted_proxies = parse_networks(trusted_proxies or [])
        self.body_read_timeout = body_read_timeout
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        services = getattr(getattr(scope.get("app"), "state", None), "services", None)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"")
        client_id = given.decode("ascii") if _SANE_ID.match(given) else None
        request_id = secrets.token_hex(16)  # as random as uuid4().hex, a fifth of its cost
        arrival_time, arrival_perf = time.time(), time.perf_counter()
        state = scope.setdefault("state", {})
        addr = client_address(scope, headers, self.trusted_proxies)
        if self.trusted_proxies:
            scheme = forwarded_scheme(scope, headers, self.trusted_proxies)
            if scheme is not None:
                scope["scheme"] = scheme
        bucket = state["client_bucket"] = limit_key(addr)  # an IPv6 client's /64: it holds many
        endpoint = None
        if scope["method"] == "POST":
            endpoint = INFERENCE_PATHS.get(scope["path"]) or RELAYED_PATHS.get(scope["path"])
        tracker = None
        if endpoint is not None and services is not None:
            context = RequestContext(
                request_id, client_id, endpoint, arrival_time, arrival_perf, addr, bucket
            )
            tracker = state["tracker"] = RequestTracker(context)
            services.metrics.in_flight.inc()
        rid_header = (b"x-request-id", (client_id or request_id).encode())
        sent: list[int] = []  # the status actually sent, once the response started
        too_large = False  # set by the body reader; whatever the app answers then becomes a 413
        limit = self.max_body_bytes

        async def send_raw(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        async def send_with_id(message: Message) -> None:
            if too_large and not sent:
                await self._send_error(BodyTooLarge(limit), send_raw)
                return
            if too_large:
                return  # the app's own answer (a body-parse error) is replaced by the 413 above
            await send_raw(message)

        seen = 0
        body_done = False
        body_deadline = arrival_perf + self.body_timeout
        read_timeout = self.body_read_timeout

        async def limited_receive() -> Message:
            # Bodies without a content-length are counted as they arrive. Until the body is in,
            # each read has a deadline, and so has the whole body; after it, a read waits for the
            # client's disconnect, however long the answer takes.
            nonlocal seen, too_large, body_done
            if body_done:
                return await receive()
            left = body_deadline - time.perf_counter()
            try:
                async with asyncio.timeout(min(read_timeout, left)):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(
                    f"nothing for {read_timeout:g} s"
                    if left > read_timeout
                    else f"{self.body_timeout:g} s in all"
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limit:
                    too_large = True
                    raise BodyTooLarge(limit)
            else:
                body_done = True
            return message

        escaped: BaseException | None = None
        try:
            declared = headers.get(b"content-length")
            if services is not None and self._refused(services, scope, headers, bucket):
                await self._send_error(_too_many_refusals(services.refusals.retry_after(bucket)), send_raw)
            elif declared is not None and declared.isdigit() and int(declared) > limit:
                await self._send_error(BodyTooLarge(limit), send_raw)
            else:
                await self.app(scope, limited_receive, send_with_id)
        except ClientDisconnect:
            # Gone before its body was in: nothing to answer, nobody's fault but the client's.
            if tracker is not None:
                tracker.cancelled("client_disconnected")
        except Exception as exc:
            escaped = exc
            if sent:
                raise
            error = (
                exc
                if isinstance(exc, GatewayError)
                else GatewayError(500, "internal server error", code="internal_error")
            )
            if not isinstance(exc, GatewayError):
                logger.exception("unhandled error on %s", scope.get("path"))
            if tracker is not None:
                tracker.refused(error.code)
            release(state.get("held"))  # before the client can read the refusal and ask again
            await self._send_error(error, send_with_id)
        except BaseException as exc:  # cancelled: the record still lands
            escaped = exc
            raise
        finally:
            release(state.get("held"))
            status = sent[0] if sent else None
            if services is not None:
                if status in REFUSALS:
                    services.refusals.charge(bucket)
                if tracker is not None:
                    services.metrics.in_flight.dec()
                    services.complete(tracker.finish(status, escaped), tracker.prefix_blocks)

    @staticmethod
    def _refused(services: Any, scope: Scope, headers: dict[bytes, bytes], bucket: str) -> bool:
        """Whether this request is turned away for its address's refusals: not probes, and not a
        request carrying a valid key or dashboard session (a neighbour behind the same NAT guessing
        keys must not lock out the clients that hold one)."""
        if scope["path"] in UNLIMITED_PATHS or not services.refusals.exhausted(bucket):
            return False
        token = bearer(headers.get(b"authorization", b"").decode("latin-1"))
        admin = services.settings.admin_key
        accepted = [*services.api_keys, *([admin.get_secret_value()] if admin is not None else [])]
        if check_key(token, accepted):
            return False
        # The dashboard's browser holds a signed session cookie instead of a key.
        if b"cookie" not in headers or not scope["path"].startswith("/admin"):
            return True
        request = Request(scope)
        dashboard = dashboard_auth(request)
        return dashboard is None or dashboard.signed_session(request) is None

    @staticmethod
    async def _send_error(error: GatewayError, send: Any) -> None:
        response = error_response(error)
        headers = response.raw_headers
        if error.status == 408:  # the rest of a late body may still come: not on this connection
            headers = [*headers, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})


def _too_many_refusals(retry_after: float) -> GatewayError:
    return GatewayError(
        429,
        "Too many refused requests (bad keys or oversized bodies) from this address; slow down.",
        code="rate_limit_exceeded",
        retry_after=retry_after,
    )
