"""Two gateways built as workers of one supervisor (`Services` with a WorkerContext), in this process:
one rate limit between them, every record through the one relay into the one database, and a policy
edit made through one live in the other. (tests/gateway/serve/ runs the real supervisor.)"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.relay import RecordRelayServer
from specgate.gateway.telemetry.store import TelemetryStore
from specgate.gateway.telemetry.tables import requests
from specgate.gateway.worker_context import WorkerContext
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for

ADMIN = {"authorization": "Bearer adm-key-0123456789"}


@pytest.fixture
def run_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))  # short: a Unix socket lives here
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_two_workers_agree(tiny_llama_dir: Path, run_dir: Path) -> None:
    settings: Settings = tiny_settings(
        str(tiny_llama_dir),
        rate_limit_rpm=30,  # bursts of 5: alone, each worker would let 5 through
        admin_key="adm-key-0123456789",
        log_requests=False,
        telemetry={"url": f"sqlite:///{run_dir / 't.db'}", "auto_upgrade": True, "flush_interval": 0.02},
        policy={"sync_interval": 0.1},
    )
    # The supervisor's part (serve/shared.py): the store and its relay, the limit tables.
    store = TelemetryStore(settings.telemetry)
    store.open()
    relay = RecordRelayServer(store, str(run_dir / "telemetry.sock")).start()
    limits = SharedLimits.create(settings)
    workers: list[LiveGateway] = []
    try:
        for i in range(2):  # one after the other: the first records the default policy version
            ctx = WorkerContext(i, 2, str(run_dir), None, relay.path, None, limits)
            workers.append(start_gateway(settings, worker=ctx))
        statuses = [
            httpx.post(f"{workers[n % 2].url}/v1/chat/completions", json={}, timeout=30).status_code
            for n in range(16)
        ]
        assert 5 <= sum(s != 429 for s in statuses) <= 6  # one burst (and a refill) for both, not two
        assert statuses.count(429) >= 10

        r = httpx.put(f"{workers[0].url}/admin/policy", json={"min_confidence": 0.7}, headers=ADMIN)
        assert r.status_code == 200, r.text
        version = r.json()["version"]["version"]

        def follows() -> bool:
            body = httpx.get(f"{workers[1].url}/admin/policy", headers=ADMIN, timeout=10).json()
            return bool(body["version"] == version and body["rules"]["min_confidence"] == 0.7)

        assert wait_for(follows, timeout=10)
        for w in workers:  # their own writers: none; the relay's counters instead
            assert w.services.store is not None and w.services.store.writer is None
    finally:
        for w in workers:
            w.stop()  # flushes its relay
        relay.close()
        limits.close()
    assert store.writer is not None and store.writer.flush(20)
    with store.engine.connect() as conn:
        landed = conn.execute(select(func.count()).select_from(requests)).scalar_one()
    store.close()
    assert landed == 16 and relay.counters.records == 16
