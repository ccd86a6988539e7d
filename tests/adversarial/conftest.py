"""A live gateway under attack: the tiny model, SQLite telemetry, and helpers that check the gateway
is still whole (engine ready, /metrics answering, exactly one row per /v1 request)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

ADMIN = "adm-fuzz-0123456789"


def telemetry(tmp: Path) -> dict[str, Any]:
    return {"url": f"sqlite:///{tmp / 'telemetry.db'}", "auto_upgrade": True, "flush_interval": 0.02}


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    """Open mode (no keys): the worst case, anyone may send anything."""
    tmp = tmp_path_factory.mktemp("adversarial")
    settings = tiny_settings(
        str(tiny_llama_dir), telemetry=telemetry(tmp), admin_key=ADMIN, log_requests=False, refused_rpm=0
    )
    live = start_gateway(settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def send(live: LiveGateway, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` as JSON text, NaN / Infinity / lone surrogates included when the body holds them."""
    raw = (
        body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    )
    hs = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{live.url}{path}", content=raw, headers=hs, timeout=60)


def rows_for(live: LiveGateway, client_ids: list[str]) -> dict[str, int]:
    """How many telemetry rows each client x-request-id left (the writer flushed first)."""
    store = live.services.store
    assert store is not None
    assert store.writer.flush(20)
    engine = schema.make_engine(store.url)
    try:
        with engine.connect() as conn:
            got = dict(
                conn.execute(
                    select(requests.c.client_request_id, func.count())
                    .where(requests.c.client_request_id.in_(client_ids))
                    .group_by(requests.c.client_request_id)
                ).all()
            )
    finally:
        engine.dispose()
    return {rid: int(got.get(rid, 0)) for rid in client_ids}


def assert_whole(live: LiveGateway) -> None:
    """The engine serves, /metrics renders, nothing is stuck in telemetry."""
    deadline = time.monotonic() + 30
    while httpx.get(f"{live.url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, httpx.get(f"{live.url}/readyz").text
        time.sleep(0.1)
    metrics = httpx.get(f"{live.url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "specgate_requests_total" in metrics.text
    store = live.services.store
    assert store is not None and store.writer.counters.dropped == 0


def assert_openai_error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code != 500 and not (r.status_code >= 500 and r.status_code not in (502, 503, 504)), (
        r.text
    )
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]
    return err
