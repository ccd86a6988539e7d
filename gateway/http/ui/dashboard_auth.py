"""How the dashboard's browser proves it is an operator: the session cookie (session.py), the CSRF
header on actions, and a same-origin check on anything it posts.

Built once per app by `create_app` (no admin key, or the dashboard disabled: there is none, and
only bearer keys open /admin). Sign-outs are kept in the telemetry database (`revocations`, set
once the app's services exist), so that no worker, replica or restart takes a signed-out cookie
again; without a database they last as long as the gateway runs, which start-up says.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from specgate.gateway.http.auth import check_key
from specgate.gateway.http.ui.session import COOKIE, CSRF_HEADER, Session, SessionSigner
from specgate.gateway.http.ui.signin_guard import SignInGuard
from specgate.gateway.limits.shared import SharedLimits, attached
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import Settings, UISettings
from specgate.gateway.telemetry.revocations import SessionRevocations

logger = logging.getLogger("specgate.gateway")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def admin_guard(settings: Settings, shared_limits: SharedLimits | None = None) -> SignInGuard | None:
    """The one count of failed admin-key attempts per address, for the sign-in form and the bearer
    admin path alike (None: no admin key, so nothing to guess)."""
    if settings.admin_key is None:
        return None
    shared = attached(shared_limits)
    ui = settings.ui
    return SignInGuard(ui.max_failed_signins, ui.signin_lockout, shared.signins if shared else None)


@dataclass
class DashboardAuth:
    settings: UISettings
    signer: SessionSigner
    guard: SignInGuard
    admin_key: str = field(repr=False)
    revocations: SessionRevocations | None = None

    @classmethod
    def build(
        cls, settings: Settings, guard: SignInGuard | None, shared_limits: SharedLimits | None = None
    ) -> DashboardAuth | None:
        """`shared_limits`: a worker's (see limits/shared.py): sign-outs count for all of them."""
        if settings.admin_key is None or not settings.ui.enabled or guard is None:
            return None
        ui, key = settings.ui, settings.admin_key.get_secret_value()
        shared = attached(shared_limits)
        signer = SessionSigner(key, ui.session_ttl, shared.revoked if shared else None)
        return cls(ui, signer, guard, key)

    def is_admin_key(self, presented: str) -> bool:
        return check_key(presented, [self.admin_key])

    def signed_session(self, request: Request) -> Session | None:
        """The cookie's session as far as its signature, expiry and this gateway's own sign-outs
        tell (no database read: for decisions that grant nothing, like the refusal budget's)."""
        return self.signer.verify(request.cookies.get(COOKIE))

    async def session(self, request: Request) -> Session | None:
        """The request's session, unless it is signed out anywhere (the database is asked)."""
        session = self.signed_session(request)
        if session is None or self.revocations is None:
            return session
        try:
            revoked = await asyncio.to_thread(self.revocations.revoked, session.sid)
        except Exception as exc:  # cannot tell: a session must not outlive its sign-out
            logger.warning("dashboard session check failed: %s", exc)
            raise GatewayError(
                503,
                "Cannot check the dashboard session now (the telemetry database is unreachable); "
                "use the admin key as 'Authorization: Bearer <key>'.",
                code="session_store_unavailable",
                retry_after=5,
            ) from None
        if revoked:
            self.signer.forget(session)
            return None
        return session

    async def sign_out(self, session: Session) -> None:
        self.signer.revoke(session)
        if self.revocations is None:
            return
        try:
            await asyncio.to_thread(self.revocations.add, session.sid, session.expires)
        except Exception:
            logger.exception("the sign-out could not be stored; other replicas may still take the cookie")

    async def authorize(self, request: Request) -> Session | None:
        """The request's session if its cookie is valid; for a request that changes something, only
        with the session's CSRF token and from this origin (else 403: a forged cross-site action)."""
        session = await self.session(request)
        if session is None or request.method in SAFE_METHODS:
            return session
        if not same_origin(request):
            raise GatewayError(403, "cross-origin request refused", code="csrf_failed")
        if not self.signer.check_csrf(session, request.headers.get(CSRF_HEADER)):
            raise GatewayError(
                403, f"missing or wrong {CSRF_HEADER} header for this session", code="csrf_failed"
            )
        return session

    def secure(self, request: Request) -> bool:
        mode = self.settings.secure_cookie
        return mode == "always" or (mode == "auto" and request.url.scheme == "https")

    def set_cookie(self, response: Response, request: Request, value: str) -> None:
        response.set_cookie(
            COOKIE,
            value,
            max_age=int(self.settings.session_ttl),
            path="/admin",
            secure=self.secure(request),
            httponly=True,
            samesite="strict",
        )

    def clear_cookie(self, response: Response, request: Request) -> None:
        response.delete_cookie(
            COOKIE, path="/admin", secure=self.secure(request), httponly=True, samesite="strict"
        )


def same_origin(request: Request) -> bool:
    """Whether the browser says the request comes from this site (no Origin header: not a browser's
    cross-site request, which always carries one on POST / PUT / DELETE)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    host = request.headers.get("host")
    return origin != "null" and host is not None and urlsplit(origin).netloc == host


def dashboard_auth(request: Request) -> DashboardAuth | None:
    auth: DashboardAuth | None = getattr(request.app.state, "dashboard", None)
    return auth
