"""FastAPI dependencies, as `Annotated` aliases the routers use.

All `async def`: FastAPI runs plain `def` dependencies in a worker thread, two thread hops per
request that queue behind each other under load (measured: ~100 ms at 100 in flight).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from specgate.gateway.http.auth import bearer_token, check_key, key_id, unauthorized
from specgate.gateway.http.ui.dashboard_auth import dashboard_auth
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.services import Services


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def api_key(request: Request, svc: ServicesDep) -> str | None:
    """The caller's key id (for records), after checking the key if keys are set, then the rate limit:
    per key when keys are set, per client address in open mode (where any bearer string is accepted,
    so a client could otherwise mint itself a fresh limit with each request)."""
    keys = svc.api_keys
    token = bearer_token(request)
    if keys:
        if token is None:
            raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
        if not check_key(token, keys):
            raise unauthorized()
    ident = key_id(token) if token else None
    record = getattr(request.state, "record", None)
    if record is not None:
        record.api_key_id = ident
    bucket = getattr(request.state, "client_bucket", None) or "unknown"  # set by the middleware
    svc.limiter.check(ident if keys and ident else f"addr:{bucket}")
    return ident


ApiKeyDep = Annotated[str | None, Depends(api_key)]


async def admin_key(request: Request, svc: ServicesDep) -> None:
    key = svc.settings.admin_key
    if key is None:
        raise GatewayError(
            403, "The admin API is disabled: set an admin key to enable it.", code="admin_disabled"
        )
    token = bearer_token(request)
    if token is None:
        # The dashboard's browser: a signed session cookie (and, for actions, its CSRF header).
        dashboard = dashboard_auth(request)
        if dashboard is not None and dashboard.authorize(request) is not None:
            return
        raise unauthorized("The admin API needs the admin key as 'Authorization: Bearer <key>'.")
    if check_key(token, [key.get_secret_value()]):
        return
    if check_key(token, [k.get_secret_value() for k in svc.settings.api_keys]):
        raise GatewayError(403, "This API key may call /v1 but not the admin API.", code="forbidden")
    raise unauthorized("Incorrect admin key provided.")


AdminDep = Annotated[None, Depends(admin_key)]
