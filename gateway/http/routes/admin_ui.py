"""/admin/ui: the operator dashboard's pages and files (the data comes from the JSON admin API).

The page itself is only served to a signed-in browser; anyone else is sent to the sign-in form. The
static files hold no data and no secret, so the sign-in page can use them before a session exists.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from specgate.gateway.http.ui.assets import asset, page
from specgate.gateway.http.ui.dashboard_auth import dashboard_auth
from specgate.gateway.protocol.errors import GatewayError

router = APIRouter(prefix="/admin/ui", include_in_schema=False)

LOGIN = "/admin/ui/login"


def _disabled() -> GatewayError:
    return GatewayError(
        403,
        "The dashboard is disabled: set an admin key (and leave ui.enabled on) to enable it.",
        code="admin_disabled",
    )


@router.get("")
@router.get("/")
async def dashboard(request: Request) -> Response:
    auth = dashboard_auth(request)
    if auth is None:
        raise _disabled()
    if await auth.session(request) is None:
        return RedirectResponse(LOGIN, status_code=303)
    return page("index.html")


@router.get("/login")
async def login_page(request: Request) -> Response:
    auth = dashboard_auth(request)
    if auth is None:
        raise _disabled()
    if await auth.session(request) is not None:
        return RedirectResponse("/admin/ui", status_code=303)
    return page("login.html", error="", hidden="hidden")


@router.get("/static/{name}")
async def static_file(name: str) -> Response:
    found = asset(name)
    if found is None:
        raise GatewayError(404, "no such dashboard file", code="not_found")
    return found
