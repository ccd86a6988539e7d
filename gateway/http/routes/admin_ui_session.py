"""/admin/ui/login, /admin/ui/logout, /admin/ui/session: the dashboard's sign-in.

The admin key travels once, in a POST body (a form field or JSON), never in a URL, and is never
logged or echoed; it buys a signed session cookie (HttpOnly, SameSite=Strict, Path=/admin, Secure
over HTTPS). Failed sign-ins are limited per client address (ui.max_failed_signins, then
ui.signin_lockout seconds of 429 whatever the key), counted together with wrong bearer keys on
/admin (deps.admin_key): the two paths share one budget.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from specgate.gateway.http.body import loads, validate
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.http.ui.assets import SECURITY_HEADERS, page
from specgate.gateway.http.ui.dashboard_auth import DashboardAuth, dashboard_auth, same_origin
from specgate.gateway.protocol.dashboard_schemas import SessionInfo, SignIn
from specgate.gateway.protocol.errors import GatewayError, invalid

logger = logging.getLogger("specgate.gateway")
router = APIRouter(prefix="/admin/ui", tags=["admin"])
FORM = "application/x-www-form-urlencoded"


def _auth(request: Request) -> DashboardAuth:
    auth = dashboard_auth(request)
    if auth is None:
        raise GatewayError(
            403, "The dashboard is disabled: set an admin key to enable it.", code="admin_disabled"
        )
    return auth


def _presented_key(raw: bytes, form: bool) -> str:
    if form:
        try:
            fields = parse_qs(raw.decode("utf-8"), max_num_fields=8, strict_parsing=False)
        except (UnicodeDecodeError, ValueError):
            raise invalid("the sign-in form is not valid", code="invalid_value") from None
        data: dict[str, Any] = {k: v[0] for k, v in fields.items()}
    else:
        data = loads(raw)
    return validate(SignIn, data, status=422).key


def _refused(form: bool, error: GatewayError) -> Response:
    if not form:
        return SafeJSONResponse(error.body(), status_code=error.status, headers=error.headers())
    response = page("login.html", status=error.status, error=error.message, hidden="")
    response.headers.update(error.headers())
    return response


@router.post(
    "/login",
    summary="Sign the dashboard in: the admin key for a session cookie",
    openapi_extra=json_body(SignIn),
    responses={200: {"model": SessionInfo}, 303: {"description": "signed in (form): to the dashboard"}},
)
async def login(request: Request) -> Response:
    auth = _auth(request)
    form = request.headers.get("content-type", "").split(";")[0].strip().lower() == FORM
    if not same_origin(request):
        return _refused(form, GatewayError(403, "cross-origin sign-in refused", code="csrf_failed"))
    addr = getattr(request.state, "client_bucket", None) or "unknown"
    wait = auth.guard.retry_after(addr)
    if wait:
        logger.warning("dashboard sign-in from %s refused: too many failed attempts", addr)
        message = f"Too many failed sign-ins from this address; try again in {int(wait)} s."
        return _refused(form, GatewayError(429, message, code="rate_limit_exceeded", retry_after=wait))
    try:
        key = _presented_key(await request.body(), form)
    except GatewayError as exc:
        return _refused(form, exc)
    if not auth.is_admin_key(key):
        auth.guard.failed(addr)
        logger.warning("dashboard sign-in from %s refused: wrong key", addr)
        return _refused(form, GatewayError(401, "Wrong admin key.", code="invalid_api_key"))
    auth.guard.succeeded(addr)
    cookie, session = auth.signer.issue()
    logger.info("dashboard sign-in from %s", addr)
    response: Response
    if form:
        response = RedirectResponse("/admin/ui", status_code=303)
    else:
        info = SessionInfo(
            issued_at=session.issued, expires_at=session.expires, csrf_token=auth.signer.csrf_token(session)
        )
        response = JSONResponse(info.model_dump(), headers={"cache-control": "no-store"})
    auth.set_cookie(response, request, cookie)
    return response


@router.get("/session", summary="The dashboard session: expiry and the CSRF token for actions")
async def session_info(request: Request, response: Response) -> SessionInfo:
    auth = _auth(request)
    response.headers["cache-control"] = "no-store"
    session = await auth.session(request)
    if session is None:
        raise GatewayError(401, "Not signed in (or the session expired).", code="invalid_api_key")
    return SessionInfo(
        issued_at=session.issued, expires_at=session.expires, csrf_token=auth.signer.csrf_token(session)
    )


@router.post("/logout", summary="Sign the dashboard out: the session ends and its cookie is cleared")
async def logout(request: Request) -> Response:
    auth = _auth(request)
    session = await auth.authorize(request)  # a cross-site page may not sign an operator out either
    if session is not None:
        await auth.sign_out(session)
        logger.info("dashboard sign-out")
    response = Response(status_code=204, headers=dict(SECURITY_HEADERS))
    auth.clear_cookie(response, request)
    return response
