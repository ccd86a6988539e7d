"""Session cookies and the sign-in guard, without a server: signatures, expiry, revocation, junk;
the CSRF token; the failed sign-in limit and its lockout; both shared by worker processes."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest

from specgate.gateway.http.ui.session import SessionSigner
from specgate.gateway.http.ui.signin_guard import SignInGuard
from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.settings import Settings


def test_a_cookie_round_trips_and_any_other_key_refuses_it() -> None:
    signer = SessionSigner("adm-1", ttl=3600)
    cookie, session = signer.issue(now=1000.0)
    assert "adm-1" not in cookie
    assert signer.verify(cookie, now=1001.0) == session
    # Another process with the same admin key (another worker, a replica) accepts it...
    assert SessionSigner("adm-1", ttl=60).verify(cookie, now=1001.0) == session
    # ...one with another key does not (a new admin key ends every session).
    assert SessionSigner("adm-2", ttl=3600).verify(cookie, now=1001.0) is None


def test_expiry_and_clock() -> None:
    signer = SessionSigner("adm-1", ttl=3600)
    cookie, _ = signer.issue(now=1000.0)
    assert signer.verify(cookie, now=4599.0) is not None
    assert signer.verify(cookie, now=4600.0) is None  # expired
    assert signer.verify(cookie, now=900.0) is None  # issued in the future: forged or a broken clock


def test_a_tampered_payload_is_refused() -> None:
    signer = SessionSigner("adm-1", ttl=3600)
    cookie, _ = signer.issue(now=1000.0)
    body, sig = cookie.split(".")
    data = json.loads(base64.urlsafe_b64decode(body + "=="))
    data["exp"] += 10**6  # a longer session, same signature
    forged = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    assert signer.verify(f"{forged}.{sig}", now=1001.0) is None


@pytest.mark.parametrize(
    "junk",
    [
        "",
        ".",
        "a.b",
        "a.b.c",
        "x" * 600,
        "é.é",
        "%%%.%%%",
        "e30.",
        "bnVsbA.AAAA",
        "\x00.\x00",
        "a" * 10 + ".",
    ],
)
def test_junk_cookies_are_just_absent(junk: str) -> None:
    assert SessionSigner("adm-1", ttl=3600).verify(junk) is None


def test_a_signed_but_malformed_payload_is_refused() -> None:
    signer = SessionSigner("adm-1", ttl=3600)
    for payload in (b"[]", b'{"sid": 1}', b"not json", b'{"sid": "a", "iat": "x", "exp": 1}'):
        body = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
        mac = base64.urlsafe_b64encode(signer._mac(b"cookie", payload)).rstrip(b"=").decode()
        assert signer.verify(f"{body}.{mac}") is None


def test_revocation_and_csrf() -> None:
    signer = SessionSigner("adm-1", ttl=3600)
    cookie, session = signer.issue()
    token = signer.csrf_token(session)
    assert signer.check_csrf(session, token)
    _, other = signer.issue()
    assert not signer.check_csrf(other, token)  # bound to its session
    assert (
        not signer.check_csrf(session, None)
        and not signer.check_csrf(session, "")
        and not signer.check_csrf(session, "é" * 10)
    )
    signer.revoke(session)
    assert signer.verify(cookie) is None


def test_failed_signins_lock_an_address_out_then_expire() -> None:
    guard = SignInGuard(max_failures=3, lockout=60.0)
    for t in (0.0, 1.0, 2.0):
        assert guard.retry_after("1.2.3.4", now=t) == 0.0
        guard.failed("1.2.3.4", now=t)
    assert guard.retry_after("1.2.3.4", now=3.0) == pytest.approx(57.0)
    assert guard.retry_after("5.6.7.8", now=3.0) == 0.0  # another address is not affected
    assert guard.retry_after("1.2.3.4", now=60.5) == 0.0  # the oldest failure has aged out
    for t in (61.0, 70.0, 71.0):  # the failures at 1 and 2 age out meanwhile
        guard.failed("1.2.3.4", now=t)
    assert guard.retry_after("1.2.3.4", now=71.5) == pytest.approx(61.0 + 60.0 - 71.5)
    guard.succeeded("1.2.3.4")  # a sign-in with the right key, before the limit, clears them
    assert guard.retry_after("1.2.3.4", now=71.5) == 0.0


@pytest.fixture
def shared() -> Iterator[SharedLimits]:
    handle = SharedLimits.create(Settings(ui={"max_failed_signins": 3, "signin_lockout": 60.0}))
    yield handle
    handle.close()


def test_a_sign_out_is_seen_by_every_worker(shared: SharedLimits) -> None:
    # Two workers: two signers over one attachment (as two processes over one segment).
    a = SessionSigner("adm-1", ttl=3600, shared=shared.attach().revoked)
    b = SessionSigner("adm-1", ttl=3600, shared=shared.attach().revoked)
    cookie, session = a.issue()
    seen = b.verify(cookie)
    assert seen is not None and seen.sid == session.sid
    a.revoke(session)
    assert a.verify(cookie) is None and b.verify(cookie) is None
    other, _ = b.issue()
    assert a.verify(other) is not None  # only that session


def test_shared_failed_signins_count_across_workers(shared: SharedLimits) -> None:
    """In worker mode the limit is a bucket: 3 tries at once, then one every 60 / 3 seconds."""
    guards = [SignInGuard(3, 60.0, shared.attach().signins) for _ in range(2)]  # two workers
    for t, guard in ((0.0, guards[0]), (1.0, guards[1]), (2.0, guards[0])):
        assert guard.retry_after("1.2.3.4", now=t) == 0.0
        guard.failed("1.2.3.4", now=t)
    for guard in guards:  # locked out on both, whichever counted the failures
        assert guard.retry_after("1.2.3.4", now=3.0) == 17.0  # one try back at 0.15 + 17 * 0.05
        assert guard.retry_after("5.6.7.8", now=3.0) == 0.0
    assert guards[1].retry_after("1.2.3.4", now=20.5) == 0.0
    guards[1].failed("1.2.3.4", now=20.5)
    assert guards[0].retry_after("1.2.3.4", now=20.5) > 0.0
    guards[0].succeeded("1.2.3.4")  # the right key: the address starts again
    assert guards[1].retry_after("1.2.3.4", now=20.5) == 0.0
    with pytest.raises(ValueError):  # the supervisor's limits and this worker's settings disagree
        SignInGuard(5, 60.0, shared.attach().signins)
