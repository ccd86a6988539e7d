"""Dashboard sessions: a signed, expiring cookie instead of the admin key on every request.

The signing key is derived from the admin key (HMAC with a fixed label), not drawn at random per
process: every worker process of a gateway, and every replica with the same configuration, accepts
the same cookies, and changing the admin key ends every session at once. The cookie carries no key,
only an id, its issue and expiry times and a signature. A CSRF token is derived from the session id
with the same key: it is handed to the page (never set as a cookie), and actions that change
anything must send it back in a header that a cross-site form cannot set.

Signing out revokes the session id until the cookie would have expired anyway. The revoked ids are
kept here, in shared memory with several worker processes (`shared`, limits/shared.py), and in the
telemetry database (dashboard_auth.py), which every replica and restart reads.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from specgate.gateway.limits.shared_buckets import SharedRevocations

COOKIE = "specgate_admin"
CSRF_HEADER = "x-csrf-token"
MAX_COOKIE_CHARS = 512  # ours are ~150; anything longer is junk and never parsed
_LABEL = b"specgate/admin-ui/session/v1"
MAX_REVOKED = 10_000  # signed-out sessions remembered until they expire (oldest forgotten first)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True, slots=True)
class Session:
    sid: str
    issued: float
    expires: float


class SessionSigner:
    def __init__(self, admin_key: str, ttl: float, shared: SharedRevocations | None = None) -> None:
        self._key = hmac.new(admin_key.encode("utf-8", "surrogatepass"), _LABEL, hashlib.sha256).digest()
        self.ttl = ttl
        self._revoked: OrderedDict[str, float] = OrderedDict()  # this process's sign-outs
        self.shared = shared  # every worker's sign-outs; None: a single-process gateway

    def _mac(self, purpose: bytes, payload: bytes) -> bytes:
        return hmac.new(self._key, purpose + b"\x00" + payload, hashlib.sha256).digest()

    def issue(self, now: float | None = None) -> tuple[str, Session]:
        now = time.time() if now is None else now
        session = Session(secrets.token_hex(16), now, now + self.ttl)
        payload = json.dumps(
            {"sid": session.sid, "iat": int(session.issued), "exp": int(session.expires)},
            separators=(",", ":"),
        ).encode()
        return f"{_b64(payload)}.{_b64(self._mac(b'cookie', payload))}", session

    def verify(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session a cookie value stands for, or None (absent, forged, expired, signed out, junk)."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        body, _, sig = cookie.partition(".")
        try:
            payload, mac = _unb64(body), _unb64(sig)
        except (ValueError, TypeError):
            return None
        if not hmac.compare_digest(mac, self._mac(b"cookie", payload)):
            return None
        try:
            data = json.loads(payload)
            session = Session(str(data["sid"]), float(data["iat"]), float(data["exp"]))
        except (ValueError, TypeError, KeyError):
            return None
        now = time.time() if now is None else now
        if not session.issued - 60 <= now < session.expires or session.sid in self._revoked:
            return None
        if self.shared is not None and self.shared.revoked(session.sid, now):
            return None
        return session

    def csrf_token(self, session: Session) -> str:
        return _b64(self._mac(b"csrf", session.sid.encode()))

    def check_csrf(self, session: Session, token: str | None) -> bool:
        if not token or len(token) > 128:
            return False
        return hmac.compare_digest(token.encode("ascii", "replace"), self.csrf_token(session).encode())

    def revoke(self, session: Session) -> None:
        if self.shared is not None:
            self.shared.add(session.sid, session.expires)
        self.forget(session)

    def forget(self, session: Session) -> None:
        """Refuse `session` in this process from now on (it was signed out, here or elsewhere)."""
        now = time.time()
        self._revoked[session.sid] = session.expires
        while self._revoked and (
            len(self._revoked) > MAX_REVOKED or next(iter(self._revoked.values())) <= now
        ):
            self._revoked.popitem(last=False)
