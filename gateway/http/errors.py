"""Errors on the wire: GatewayError rendered as a response, pydantic's errors as one GatewayError,
and the app's exception handlers.

Every failure leaves the gateway OpenAI-shaped; an unexpected exception is logged with its
traceback and answered with a generic 500 body that carries no internals.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.protocol.errors import GatewayError, invalid
from specgate.gateway.protocol.schemas import MESSAGE_ROLES


def error_response(error: GatewayError) -> JSONResponse:
    return SafeJSONResponse(error.body(), status_code=error.status, headers=error.headers())


logger = logging.getLogger("specgate.gateway")
MAX_PARAM = 200  # a parameter path or message fragment echoed back is cut here
_MEMBER = re.compile(r"[\[\]-]")  # union members: list[int], constrained-str, function-after[...]
_TYPES_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def post_only(method: str) -> JSONResponse | None:
    """The 405 a raw ASGI POST route answers any other method with (None for POST)."""
    if method == "POST":
        return None
    refusal = error_response(GatewayError(405, "Method Not Allowed"))
    refusal.headers["allow"] = "POST"
    return refusal


def _param(loc: Sequence[Any]) -> str | None:
    """A pydantic error location as the dotted parameter the client sent.

    pydantic names union members (`prompt.list[int]`, `stop.constrained-str`) and the message type
    a role selected (`messages.0.user.content`); the client named neither, so they go."""
    raw = [p for p in loc if p != "body"]
    keep = []
    for i, part in enumerate(raw):
        if isinstance(part, str) and (
            _MEMBER.search(part)
            or part in _TYPES_NAMES
            or (i and isinstance(raw[i - 1], int) and part in MESSAGE_ROLES)
        ):
            continue
        keep.append(str(part))
    return ".".join(keep)[:MAX_PARAM] or None


def validation_error(errors: Sequence[Any]) -> GatewayError:
    """pydantic's error list as one 400 naming the first offending parameter (dotted path)."""
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid("the request body is not valid JSON", code="invalid_json")
    param = _param(first.get("loc", ()))
    if first.get("type") == "union_tag_invalid":
        param = f"{param}.role" if param else "role"
    if first.get("type") == "missing":
        return invalid(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    # Of the errors about this parameter (one per union member), the one that is not about its type
    # says most ("at least 1 character" rather than "should be a valid list").
    same = [e for e in errors if _param(e.get("loc", ())) == param]
    best = next((e for e in same if not str(e.get("type", "")).endswith("_type")), first)
    msg = str(best.get("msg", "invalid value"))[:MAX_PARAM]
    return invalid(f"invalid value for {param}: {msg}" if param else msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc.errors())
        if request.url.path.startswith("/admin/"):
            error.status = 422  # the admin API speaks FastAPI's dialect; /v1 speaks OpenAI's (400)
        return error_response(error)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = "not_found" if exc.status_code == 404 else None
        error = GatewayError(exc.status_code, str(exc.detail), code=code)
        return error_response(error)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = GatewayError(500, "internal server error", code="internal_error")
        return error_response(error)

    app.add_exception_handler(GatewayError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
