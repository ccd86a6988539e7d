"""Two gateway processes (`specgate serve`, each its own supervisor and worker) on one PostgreSQL:
a policy edit or retrain made through either is live in both within seconds, and only one retrain
runs at a time across them (the lease is PostgreSQL's advisory lock, so this test's own process
holding it keeps both gateways from retraining)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.policy.store import SqlPolicyStore
from specgate.gateway.telemetry import schema
from tests.gateway.live import free_port
from tests.gateway.pg import postgres_database
from tests.policies import synthetic_telemetry as synth

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ADMIN = "adm-replicas-01234567"
HEADERS = {"authorization": f"Bearer {ADMIN}"}


def serve(url: str, tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = {
        "port": port,
        "admin_key": ADMIN,
        "embedded": {"enabled": False},
        "telemetry": {"url": url, "spool_dir": str(tmp / f"{name}-spool")},
        "policy": {"sync_interval": 0.5},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(config))
    log = (tmp / f"{name}.log").open("wb")
    cmd = [sys.executable, "-m", "specgate.gateway.cli.main", "serve", "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
        try:
            if httpx.get(f"{base}/healthz", timeout=2, trust_env=False).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"gateway {name} did not start: {(tmp / f'{name}.log').read_text()[-3000:]}")


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    with postgres_database() as url:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            a, a_url = serve(url, tmp_path, "a")
            procs.append(a)
            b, b_url = serve(url, tmp_path, "b")
            procs.append(b)
            yield url, a_url, b_url
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


def version(base: str) -> int:
    body: dict[str, Any] = httpx.get(
        f"{base}/admin/policy", headers=HEADERS, timeout=10, trust_env=False
    ).json()
    return int(body["version"])


def wait_version(base: str, want: int, within: float = 10.0) -> float:
    t0 = time.monotonic()
    while version(base) != want:
        assert time.monotonic() - t0 < within, f"{base} still at {version(base)}, expected {want}"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_two_gateway_processes_agree_on_the_policy_and_retrain_one_at_a_time(
    replicas: tuple[str, str, str],
) -> None:
    url, a, b = replicas
    assert version(a) == version(b) == 1
    # An operator's edit through a is live in b within a few seconds (b polls every 0.5 s).
    put = httpx.put(
        f"{a}/admin/policy", headers=HEADERS, json={"min_confidence": 0.7, "note": "via a"}, trust_env=False
    )
    assert put.status_code == 200, put.text
    assert version(a) == 2
    assert wait_version(b, 2) < 5.0
    rules = httpx.get(f"{b}/admin/policy", headers=HEADERS, trust_env=False).json()["rules"]
    assert rules["min_confidence"] == 0.7

    engine = schema.make_engine(url)
    try:
        synth.insert(engine, 400, seed=2)
        lease = SqlPolicyStore(engine).retrain_lease()  # another replica, retraining
        assert lease is not None
        try:
            for base in (a, b):
                busy = httpx.post(
                    f"{base}/admin/policy/retrain", headers=HEADERS, timeout=60, trust_env=False
                )
                assert busy.status_code == 409 and busy.json()["error"]["code"] == "retrain_in_progress"
        finally:
            lease.release()
        done = httpx.post(f"{b}/admin/policy/retrain", headers=HEADERS, timeout=120, trust_env=False)
        assert done.status_code == 200, done.text
        result = done.json()
        assert result["promoted"] and result["off_policy"] is not None, result["reason"]
        assert wait_version(a, result["version"]) < 5.0  # a routes by b's retrain too
    finally:
        engine.dispose()
