"""FastAPI dependencies, as `Annotated` aliases the routers use.

All `async def`: FastAPI runs plain `def` dependencies in a worker thread, two thread hops per
request that queue behind each other under load (measured: ~100 ms at 100 in flight).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from specgate.gateway.http.auth import bearer_token, check_key, unauthorized
from specgate.gateway.http.ui.dashboard_auth import dashboard_auth
from specgate.gateway.http.ui.signin_guard import SignInGuard
from specgate.gateway.limits.limiters import Concurrency, too_many_in_flight
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.request.context import Caller
from specgate.gateway.request.tracker import RequestTracker
from specgate.gateway.services import Services


async def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


ServicesDep = Annotated[Services, Depends(get_services)]


async def api_key(request: Request, svc: ServicesDep, tracker: RequestTracker | None = None) -> Caller:
    """The caller (its key's id and its tenant), after checking the key if keys are set, then the
    rate limit and the tenant's cap on requests in flight: per key when keys are set, per client
    address in open mode (where any bearer string is accepted, so a client could otherwise mint
    itself a fresh limit with each request). `tracker` (an inference request's) learns the caller
    as soon as the key is checked, so a request refused by a limit is still counted against its
    key. The request's in-flight slot is given back when its answer is made, whatever happens."""
    keys = svc.api_keys
    token = bearer_token(request)
    if keys:
        if token is None:
            raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
        if not check_key(token, keys):
            raise unauthorized()
    ident = svc.key_ids.of(token) if token else None
    state = request.state
    bucket = getattr(state, "client_bucket", None) or "unknown"  # set by the middleware
    caller = Caller(ident, ident if keys and ident else f"addr:{bucket}")
    if tracker is not None:
        tracker.caller = caller
    limits = svc.tenant_limits(ident if keys else None)
    svc.limiter_for(limits.rate_limit_rpm).check(caller.tenant)
    hold(request, svc.in_flight, f"req:{caller.tenant}", limits.max_in_flight, "requests")
    return caller


def hold(request: Request, counts: Concurrency, key: str, limit: int, what: str) -> None:
    """Take one of `key`'s in-flight slots until the request ends (`state.held`: released once the
    client has its answer, `limits.limiters.release`), or refuse the request with a 429."""
    if not counts.acquire(key, limit):
        raise too_many_in_flight(what, limit)
    held = getattr(request.state, "held", None)
    if held is None:
        held = request.state.held = []
    held.append((counts, key))


def hold_stream(request: Request, svc: Services, caller: Caller) -> None:
    """A stream counts against its tenant's cap on open streams (the raw inference routes)."""
    limit = svc.tenant_limits(caller.key_id if svc.api_keys else None).max_streams
    hold(request, svc.in_flight, f"stream:{caller.tenant}", limit, "streams")


async def _api_key(request: Request, svc: ServicesDep) -> Caller:
    return await api_key(request, svc)


ApiKeyDep = Annotated[Caller, Depends(_api_key)]


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
        if dashboard is not None and await dashboard.authorize(request) is not None:
            return
        raise unauthorized("The admin API needs the admin key as 'Authorization: Bearer <key>'.")
    # One budget of wrong guesses per address for this path and the sign-in form: once it is
    # spent, every key is refused, the right one too, so a guesser cannot tell when it hit.
    guard: SignInGuard | None = getattr(request.app.state, "admin_guard", None)
    addr = getattr(request.state, "client_bucket", None) or "unknown"
    if guard is not None and (wait := guard.retry_after(addr)):
        raise GatewayError(
            429,
            f"Too many wrong admin keys from this address; try again in {int(wait)} s.",
            code="rate_limit_exceeded",
            retry_after=wait,
        )
    if check_key(token, [key.get_secret_value()]):
        if guard is not None:
            guard.succeeded(addr)
        return
    if guard is not None:
        guard.failed(addr)
    if check_key(token, svc.api_keys):
        raise GatewayError(403, "This API key may call /v1 but not the admin API.", code="forbidden")
    raise unauthorized("Incorrect admin key provided.")


AdminDep = Annotated[None, Depends(admin_key)]


async def is_admin(request: Request, svc: ServicesDep) -> bool:
    """Whether the request carries the admin key or an operator's session, for answers that say
    more to the operator than to anyone (a wrong key costs the same budget as on /admin)."""
    if svc.settings.admin_key is None:
        return False
    if bearer_token(request) is None and dashboard_auth(request) is None:
        return False
    try:
        await admin_key(request, svc)
    except GatewayError:
        return False
    return True


AdminViewDep = Annotated[bool, Depends(is_admin)]
