"""The dashboard's sign-in over HTTP: cookie flags (Secure over HTTPS), wrong keys, the failed
sign-in limit, CSRF refusals on actions, sessions shared by every process with the admin key, junk
cookies and hostile sign-in bodies, and no key in any log line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from specgate.gateway.http.app import create_app
from specgate.gateway.http.ui.session import SessionSigner
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

KEY = "adm-Auth-51c0-0123456789"


def gateway(**ui: Any) -> LiveGateway:
    settings = tiny_settings(
        "unused",
        embedded={"enabled": False},
        telemetry={"enabled": False},
        admin_key=KEY,
        api_keys=["user-key"],
        ui=ui,
    )
    return start_gateway(settings, wait_ready=False)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveGateway]:
    gw = gateway(max_failed_signins=3, signin_lockout=2.0)
    yield gw
    gw.stop()


def sign_in(gw: LiveGateway, key: str = KEY, **kw: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}/admin/ui/login", json={"key": key}, **kw)


def session(gw: LiveGateway) -> tuple[dict[str, str], str]:
    r = sign_in(gw)
    assert r.status_code == 200, r.text
    return {"specgate_admin": r.cookies["specgate_admin"]}, r.json()["csrf_token"]


def test_sign_in_sets_a_strict_httponly_cookie(live: LiveGateway) -> None:
    r = sign_in(live)
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    flags = [f.strip().lower() for f in r.headers["set-cookie"].split(";")]
    assert "httponly" in flags and "samesite=strict" in flags and "path=/admin" in flags
    assert "max-age=28800" in flags and "secure" not in flags  # plain HTTP on loopback
    assert KEY not in r.headers["set-cookie"] and KEY not in r.text
    body = r.json()
    assert body["expires_at"] - body["issued_at"] == pytest.approx(8 * 3600, abs=1)


def test_form_sign_in_redirects_and_the_page_opens(live: LiveGateway) -> None:
    with httpx.Client(base_url=live.url) as client:
        assert client.get("/admin/ui").headers["location"] == "/admin/ui/login"
        form = client.get("/admin/ui/login")
        assert 'method="post"' in form.text and form.headers["x-frame-options"] == "DENY"
        assert "script-src 'self'" in form.headers["content-security-policy"]
        r = client.post("/admin/ui/login", data={"key": KEY})
        assert r.status_code == 303 and r.headers["location"] == "/admin/ui"
        page = client.get("/admin/ui")
        assert page.status_code == 200 and "<main" in page.text and KEY not in page.text
        assert client.get("/admin/ui/login").status_code == 303  # already signed in
        assert client.get("/admin/ui/static/app.js").headers["content-type"].startswith("text/javascript")
        for name in ("../ui/session.py", "..%2Fsession.py", "index.html", "nope.js", "APP.JS"):
            assert client.get(f"/admin/ui/static/{name}").status_code == 404


def test_secure_flag_over_https_and_when_forced() -> None:
    async def over_https() -> str:
        app = create_app(tiny_settings("unused", embedded={"enabled": False}, admin_key=KEY))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="https://gw.example") as client:
            r = await client.post("/admin/ui/login", json={"key": KEY})
            return str(r.headers["set-cookie"])

    assert "secure" in [f.strip().lower() for f in asyncio.run(over_https()).split(";")]
    forced = gateway(secure_cookie="always")
    try:
        assert "secure" in sign_in(forced).headers["set-cookie"].lower()
    finally:
        forced.stop()


def test_wrong_keys_are_refused_and_an_api_key_is_not_an_admin_key(live: LiveGateway) -> None:
    for key in ("nope", "user-key", KEY + " ", KEY.upper()):
        r = sign_in(live, key)
        assert r.status_code == 401 and "set-cookie" not in r.headers
        assert r.json()["error"]["code"] == "invalid_api_key" and key not in r.text
        live.app.state.dashboard.guard.succeeded("127.0.0.1")  # this test is not about the limit
    form = httpx.post(f"{live.url}/admin/ui/login", data={"key": "nope"})
    assert form.status_code == 401 and "Wrong admin key." in form.text and "nope" not in form.text
    live.app.state.dashboard.guard.succeeded("127.0.0.1")


def test_failed_sign_ins_are_limited(live: LiveGateway) -> None:
    for _ in range(3):
        assert sign_in(live, "guess").status_code == 401
    locked = sign_in(live, KEY)  # the right key too: a guesser must not learn when it hit
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
    assert "set-cookie" not in locked.headers
    page = httpx.post(f"{live.url}/admin/ui/login", data={"key": KEY})
    assert page.status_code == 429 and "Too many failed sign-ins" in page.text
    # The bearer admin path shares the budget: no way around the lockout, the right key included.
    bearer = httpx.get(f"{live.url}/admin/policy", headers={"authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 429 and int(bearer.headers["retry-after"]) >= 1
    live.app.state.dashboard.guard.succeeded("127.0.0.1")
    assert sign_in(live).status_code == 200


def test_wrong_bearer_admin_keys_lock_the_sign_in_form_too(live: LiveGateway) -> None:
    for i in range(3):
        r = httpx.get(f"{live.url}/admin/policy", headers={"authorization": f"Bearer guess-{i}"})
        assert r.status_code == 401
    assert (
        httpx.get(f"{live.url}/admin/policy", headers={"authorization": f"Bearer {KEY}"}).status_code == 429
    )
    assert sign_in(live, KEY).status_code == 429
    live.app.state.admin_guard.succeeded("127.0.0.1")
    assert (
        httpx.get(f"{live.url}/admin/policy", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
    )


def test_actions_need_the_csrf_token_and_this_origin(live: LiveGateway) -> None:
    cookies, token = session(live)
    url = f"{live.url}/admin/policy"
    assert httpx.get(url, cookies=cookies).status_code == 200  # reading needs no token
    patch = {"high_temperature": 0.8}
    for headers in ({}, {"x-csrf-token": "forged"}, {"x-csrf-token": token, "origin": "https://evil.example"},
                    {"x-csrf-token": token, "origin": "null"}):  # fmt: skip
        r = httpx.put(url, json=patch, cookies=cookies, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed", headers
    # Another session's token does not fit this one.
    _, other = session(live)
    assert httpx.put(url, json=patch, cookies=cookies, headers={"x-csrf-token": other}).status_code == 403
    before = httpx.get(url, cookies=cookies).json()["version"]
    ok = httpx.put(url, json=patch, cookies=cookies, headers={"x-csrf-token": token, "origin": live.url})
    assert ok.status_code == 200 and ok.json()["version"]["version"] == before + 1
    # Sign-out is an action too; a cross-site page cannot sign an operator out (or in).
    assert httpx.post(f"{live.url}/admin/ui/logout", cookies=cookies).status_code == 403
    evil = httpx.post(
        f"{live.url}/admin/ui/login", json={"key": KEY}, headers={"origin": "https://evil.example"}
    )
    assert evil.status_code == 403 and "set-cookie" not in evil.headers


def test_sign_out_revokes_and_the_session_endpoint(live: LiveGateway) -> None:
    cookies, token = session(live)
    info = httpx.get(f"{live.url}/admin/ui/session", cookies=cookies)
    assert info.status_code == 200 and info.json()["csrf_token"] == token
    out = httpx.post(f"{live.url}/admin/ui/logout", cookies=cookies, headers={"x-csrf-token": token})
    assert out.status_code == 204 and 'specgate_admin=""' in out.headers["set-cookie"]
    assert httpx.get(f"{live.url}/admin/ui/session", cookies=cookies).status_code == 401
    assert httpx.get(f"{live.url}/admin/policy", cookies=cookies).status_code == 401


@pytest.mark.slow
def test_every_process_with_the_key_accepts_the_session(live: LiveGateway) -> None:
    cookies, token = session(live)
    twin = gateway()  # another worker or replica: its own process state, the same configuration
    try:
        assert httpx.get(f"{twin.url}/admin/policy", cookies=cookies).status_code == 200
        r = httpx.put(f"{twin.url}/admin/policy", json={"high_temperature": 0.7}, cookies=cookies,
                      headers={"x-csrf-token": token})  # fmt: skip
        assert r.status_code == 200
    finally:
        twin.stop()
    other = start_gateway(
        tiny_settings("unused", embedded={"enabled": False}, admin_key="adm-other-0123456789"),
        wait_ready=False,
    )
    try:
        assert httpx.get(f"{other.url}/admin/policy", cookies=cookies).status_code == 401
    finally:
        other.stop()


@pytest.mark.slow
def test_a_signed_out_cookie_stays_refused_by_other_replicas_and_after_a_restart(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"

    def replica() -> LiveGateway:
        settings = tiny_settings(
            "unused",
            embedded={"enabled": False},
            telemetry={"url": url, "auto_upgrade": True},
            admin_key=KEY,
            log_requests=False,
        )
        return start_gateway(settings, wait_ready=False)

    a, b = replica(), replica()
    try:
        cookies, token = session(a)
        assert httpx.get(f"{b.url}/admin/policy", cookies=cookies).status_code == 200
        out = httpx.post(f"{a.url}/admin/ui/logout", cookies=cookies, headers={"x-csrf-token": token})
        assert out.status_code == 204
        # The other replica never saw the sign-out, yet refuses the cookie at once.
        assert httpx.get(f"{b.url}/admin/policy", cookies=cookies).status_code == 401
        assert httpx.get(f"{b.url}/admin/ui/session", cookies=cookies).status_code == 401
    finally:
        a.stop()
        b.stop()
    again = replica()  # a restart: no memory of the sign-out but the database's
    try:
        assert httpx.get(f"{again.url}/admin/policy", cookies=cookies).status_code == 401
        fresh, _ = session(again)
        assert httpx.get(f"{again.url}/admin/policy", cookies=fresh).status_code == 200
    finally:
        again.stop()


def test_expired_and_junk_cookies(live: LiveGateway) -> None:
    expired, _ = SessionSigner(KEY, ttl=60).issue(now=1_000_000.0)
    for value in (expired, "junk", "a.b", "x" * 5000, '"quoted"', "e30.e30"):
        jar = {"specgate_admin": value}
        r = httpx.get(f"{live.url}/admin/policy", cookies=jar)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        page = httpx.get(f"{live.url}/admin/ui", cookies=jar)
        assert page.status_code == 303
    for raw in (b"specgate_admin=; ;;=;a", b"specgate_admin=\xc3\xa9\xff", b"=" * 3000):
        r = httpx.get(f"{live.url}/admin/policy", headers={"cookie": raw})
        assert r.status_code == 401, raw


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"[1]", {"content-type": "application/json"}, 400),
        (b'{"key": 5}', {"content-type": "application/json"}, 422),
        (b'{"key": ""}', {"content-type": "application/json"}, 422),
        (b'{"key": "k", "x": 1}', {"content-type": "application/json"}, 422),
        (b"{bad", {"content-type": "application/json"}, 400),
        (b'{"key": "' + b"k" * 2000 + b'"}', {"content-type": "application/json"}, 422),
        (b"key=\xff\xfe", {"content-type": "application/x-www-form-urlencoded"}, 400),
        (b"other=1", {"content-type": "application/x-www-form-urlencoded"}, 422),
        (b"x" * (5 * 2**20), {"content-type": "application/json"}, 413),
    ],
)
def test_hostile_sign_in_bodies_are_clean_4xx(
    live: LiveGateway, body: bytes, headers: dict, status: int
) -> None:
    r = httpx.post(f"{live.url}/admin/ui/login", content=body, headers=headers)
    assert r.status_code == status, r.text


def test_the_key_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    gw = gateway()
    try:
        with caplog.at_level(logging.DEBUG):
            sign_in(gw, "adm-wrong-Secret")
            sign_in(gw)
            httpx.post(f"{gw.url}/admin/ui/login", data={"key": KEY})
    finally:
        gw.stop()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dashboard sign-in from 127.0.0.1" in text
    assert KEY not in text and "adm-wrong-Secret" not in text


def test_without_an_admin_key_there_is_no_dashboard() -> None:
    gw = start_gateway(tiny_settings("unused", embedded={"enabled": False}), wait_ready=False)
    try:
        for r in (httpx.get(f"{gw.url}/admin/ui"), httpx.post(f"{gw.url}/admin/ui/login", json={"key": "x"})):
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    finally:
        gw.stop()


@pytest.mark.slow
def test_a_session_is_not_locked_out_by_its_addresss_refusals() -> None:
    gw = start_gateway(
        tiny_settings(
            "unused",
            embedded={"enabled": False},
            telemetry={"enabled": False},
            admin_key=KEY,
            refused_rpm=60,  # bursts of ten refusals
            trusted_proxies=["127.0.0.1"],
            ui={"max_failed_signins": 50},  # this test is about the refusal budget, not the guard
        ),
        wait_ready=False,
    )
    try:
        nat = {"x-forwarded-for": "198.51.100.80"}
        cookies, _ = session(gw)
        guesses = [
            httpx.get(f"{gw.url}/admin/stats", headers={**nat, "authorization": f"Bearer g{i}"}).status_code
            for i in range(12)
        ]
        assert guesses[:10] == [401] * 10 and guesses[10:] == [429] * 2
        # A neighbour's guessing does not lock out the operator's signed-in browser...
        r = httpx.get(f"{gw.url}/admin/ui/session", headers=nat, cookies=cookies)
        assert r.status_code == 200, r.text
        # ...but a forged or junk cookie is no pass.
        for junk in ("x.y", cookies["specgate_admin"][:-2] + "AA"):
            r = httpx.get(f"{gw.url}/admin/ui/session", headers=nat, cookies={"specgate_admin": junk})
            assert r.status_code == 429
    finally:
        gw.stop()
