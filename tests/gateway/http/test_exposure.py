"""What the gateway shows and to whom: /docs and /openapi.json only when enabled, the scheme from
trusted proxies only, a client that leaves mid-body recorded as a disconnect (no traceback, no 500),
and upstream error text cut down to what a client should see."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import httpx
import pytest

from specgate.gateway.backends.upstream.answers import client_message
from specgate.gateway.http.auth import forwarded_scheme, parse_networks
from specgate.gateway.settings import Settings
from tests.gateway.live import start_gateway, tiny_settings, wait_for

KEY = "adm-exposure-0123456789"


@pytest.mark.slow
def test_docs_and_the_schema_are_off_unless_enabled(tiny_llama_dir: Path) -> None:
    assert Settings().docs is False
    live = start_gateway(tiny_settings(str(tiny_llama_dir), docs=False, log_requests=False))
    try:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(f"{live.url}{path}").status_code == 404, path
    finally:
        live.stop()
    live = start_gateway(tiny_settings(str(tiny_llama_dir), docs=True, log_requests=False))
    try:
        assert "/v1/chat/completions" in httpx.get(f"{live.url}/openapi.json").json()["paths"]
        assert httpx.get(f"{live.url}/docs").status_code == 200
    finally:
        live.stop()


def test_the_scheme_comes_from_trusted_proxies_only() -> None:
    trusted = parse_networks(["10.0.0.0/8"])

    def scheme(peer: str, proto: str) -> str | None:
        return forwarded_scheme({"client": (peer, 1)}, {b"x-forwarded-proto": proto.encode()}, trusted)

    assert scheme("10.1.2.3", "https") == "https"
    assert scheme("10.1.2.3", "http, https") == "https"  # the nearest proxy's word counts
    assert scheme("203.0.113.5", "https") is None  # anyone else: not believed
    assert scheme("10.1.2.3", "gopher") is None


def test_behind_a_tls_proxy_the_session_cookie_is_secure() -> None:
    settings = tiny_settings(
        "unused",
        embedded={"enabled": False},
        telemetry={"enabled": False},
        admin_key=KEY,
        trusted_proxies=["127.0.0.1"],
    )
    live = start_gateway(settings, wait_ready=False)
    try:
        url = f"{live.url}/admin/ui/login"
        behind = httpx.post(url, json={"key": KEY}, headers={"x-forwarded-proto": "https"})
        assert "secure" in [f.strip().lower() for f in behind.headers["set-cookie"].split(";")]
        plain = httpx.post(url, json={"key": KEY})
        assert "secure" not in [f.strip().lower() for f in plain.headers["set-cookie"].split(";")]
    finally:
        live.stop()
    untrusted = start_gateway(
        tiny_settings("unused", embedded={"enabled": False}, telemetry={"enabled": False}, admin_key=KEY),
        wait_ready=False,
    )
    try:
        r = httpx.post(
            f"{untrusted.url}/admin/ui/login", json={"key": KEY}, headers={"x-forwarded-proto": "https"}
        )
        assert "secure" not in [f.strip().lower() for f in r.headers["set-cookie"].split(";")]
    finally:
        untrusted.stop()


def test_a_client_that_leaves_mid_body_is_a_disconnect_not_an_error(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = start_gateway(tiny_settings(str(tiny_llama_dir), log_requests=False))
    try:
        with caplog.at_level(logging.INFO):
            s = socket.create_connection(("127.0.0.1", live.port))
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: left-mid-body\r\ncontent-length: 5000\r\n\r\n" + b'{"model": "x", "mess'
            )
            time.sleep(0.2)
            s.close()
            assert wait_for(lambda: live.services.recent.find("left-mid-body") is not None, 10)
        rec = live.services.recent.find("left-mid-body")
        assert rec is not None and rec.status == 499 and rec.outcome == "cancelled"
        assert rec.error_code == "client_disconnected"
        assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert "Traceback" not in caplog.text
    finally:
        live.stop()


@pytest.mark.parametrize(
    ("status", "message", "shown"),
    [
        (
            400,
            "This model's maximum context length is 4096 tokens.",
            "This model's maximum context length is 4096 tokens.",
        ),
        (400, 'bad value\nTraceback (most recent call last):\n  File "/srv/app.py"', "bad value"),
        (422, 'Traceback (most recent call last): File "/home/svc/x.py"', "backend b answered 422"),
        (400, "cannot open /opt/models/secret-name/config.json", "backend b answered 400"),
        (500, "CUDA out of memory at 0x7f00deadbeef on host gpu-17.internal", "backend b answered 500"),
        (503, "overloaded", "overloaded"),
        (500, "RuntimeError: the engine died", "backend b answered 500"),
        (502, "connect to 10.0.0.7:8000 refused", "backend b answered 502"),
        (500, "e" * 200, "backend b answered 500"),
        (400, "x" * 1000, "x" * 297 + "..."),
        (400, "\x1b[31mred\x07", "[31mred"),
    ],
)
def test_upstream_error_text_is_cut_to_what_a_client_should_see(
    status: int, message: str, shown: str
) -> None:
    assert client_message(status, message, "b") == shown
