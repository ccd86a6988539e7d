"""How the dashboard's browser proves it is an operator: the session cookie (session.py), the CSRF
header on actions, and a same-origin check on anything it posts.

Built once per app by `create_app` (no admin key, or the dashboard disabled: there is none, and
only bearer keys open /admin).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from specgate.gateway.http.auth import check_key
from specgate.gateway.http.ui.session import COOKIE, CSRF_HEADER, Session, SessionSigner
from specgate.gateway.http.ui.signin_guard import SignInGuard
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import Settings, UISettings
from specgate.gateway.shared_limits import SharedLimits, attached

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass
class DashboardAuth:
    settings: UISettings
    signer: SessionSigner
    guard: SignInGuard
    admin_key: str = field(repr=False)

    @classmethod
    def build(cls, settings: Settings, shared_limits: SharedLimits | None = None) -> DashboardAuth | None:
        """`shared_limits`: a worker's (see shared_limits.py): sign-ins and sign-outs count for all."""
        if settings.admin_key is None or not settings.ui.enabled:
            return None
        ui, key = settings.ui, settings.admin_key.get_secret_value()
        shared = attached(shared_limits)
        signer = SessionSigner(key, ui.session_ttl, shared.revoked if shared else None)
        guard = SignInGuard(ui.max_failed_signins, ui.signin_lockout, shared.signins if shared else None)
        return cls(ui, signer, guard, key)

    def is_admin_key(self, presented: str) -> bool:
        return check_key(presented, [self.admin_key])

    def session(self, request: Request) -> Session | None:
        return self.signer.verify(request.cookies.get(COOKIE))

    def authorize(self, request: Request) -> Session | None:
        """The request's session if its cookie is valid; for a request that changes something, only
        with the session's CSRF token and from this origin (else 403: a forged cross-site action)."""
        session = self.session(request)
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
