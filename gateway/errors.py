"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Every failure leaves the gateway in this shape; an unexpected exception is logged with its traceback
and answered with a generic 500 body that carries no internals.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

logger = logging.getLogger("specgate.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return invalid("the request body is not valid JSON", code="invalid_json")
    if first.get("type") == "missing":
        return invalid(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    msg = str(first.get("msg", "invalid value"))
    return invalid(f"invalid value for {param}: {msg}" if param else msg, param=param, code="invalid_value")


async def _record_rejection(request: Request, error: APIError) -> None:
    """Requests refused before the serving path took them over are recorded here."""
    if getattr(request.state, "recorded", False):
        return
    services = getattr(request.app.state, "services", None)
    if services is None:
        return
    model = None
    try:
        body = json.loads(await request.body())
        model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else None
    except Exception:  # unreadable or not JSON: the record says "unknown"
        pass
    state = request.state
    services.record_rejection(
        state.request_id, request.url.path, model, state.received_at, error.status, error.code
    )


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        await _record_rejection(request, exc)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = _validation_error(exc)
        if request.url.path.startswith("/admin/"):
            error.status = 422  # the admin API speaks FastAPI's dialect; /v1 speaks OpenAI's (400)
        await _record_rejection(request, error)
        return error.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        error = APIError(exc.status_code, str(exc.detail), code=code)
        await _record_rejection(request, error)
        return error.response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
