"""A real gateway on loopback: uvicorn in a background thread, serving `create_app(settings)`."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from specgate.gateway.http.app import create_app
from specgate.gateway.http.connections import uvicorn_options
from specgate.gateway.services import Services
from specgate.gateway.settings import Settings

# The admin key of test gateways that read /readyz's details (only the admin key sees them).
TEST_ADMIN_KEY = "adm-tests-readiness-0123"
ADMIN_HEADERS = {"authorization": f"Bearer {TEST_ADMIN_KEY}"}


def readiness(url: str) -> dict[str, Any]:
    """/readyz as the operator sees it (every check's detail, the backends)."""
    body: dict[str, Any] = httpx.get(f"{url}/readyz", headers=ADMIN_HEADERS, timeout=10).json()
    return body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LiveGateway:
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def services(self) -> Services:
        services: Services = self.app.state.services
        return services

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_gateway(
    settings: Settings, *, wait_ready: bool = True, timeout: float = 120.0, **kw: Any
) -> LiveGateway:
    port = settings.port or free_port()
    settings = settings.model_copy(update={"port": port})
    app = create_app(settings, **kw)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, **uvicorn_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    live = LiveGateway(app, server, thread, port)
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("gateway did not start")
        time.sleep(0.02)
    if wait_ready:
        wait_until_ready(live.url, deadline)
    return live


def wait_until_ready(url: str, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not become ready")
        time.sleep(0.05)


def tiny_settings(model_dir: str, **overrides: Any) -> Settings:
    embedded = {"model": model_dir, "dtype": "float32", "device": "cpu", "num_blocks": 256, "block_size": 4}
    embedded.update(overrides.pop("embedded", {}))
    overrides.setdefault("docs", True)  # the tests read /openapi.json; off by default (test_docs)
    return Settings(embedded=embedded, port=0, **overrides)


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll until `predicate()` holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def record_of(live: LiveGateway, client_request_id: str, timeout: float = 10.0) -> Any:
    """The request's record, once the gateway has settled it: the middleware submits it when the
    response is over, which may be just after the client has read the response's end."""
    deadline = time.monotonic() + timeout
    while True:
        rec = live.services.recent.find(client_request_id)
        if rec is not None or time.monotonic() > deadline:
            return rec
        time.sleep(0.01)


def stored_row(db: Any, client_request_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The request's row in the telemetry database `db` (a SQLAlchemy engine), once the writer has
    stored it (it writes in batches, after the response is over)."""
    import sqlalchemy as sa

    from specgate.gateway.telemetry.tables import requests

    deadline = time.monotonic() + timeout
    query = sa.select(requests).where(requests.c.client_request_id == client_request_id)
    while True:
        with db.connect() as conn:
            found = conn.execute(query).mappings().first()
        if found is not None:
            return dict(found)
        assert time.monotonic() < deadline, "the request's row was never written"
        time.sleep(0.02)


def records_settle(live: LiveGateway, count: int, timeout: float = 10.0) -> list[Any]:
    """The recent records once there are at least `count` of them."""
    wait_for(lambda: len(live.services.recent.records) >= count, timeout, interval=0.01)
    return list(live.services.recent.records)
