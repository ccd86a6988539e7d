"""PolicyManager over a real SQLite database: fresh install, warm start, scheduled retrain, refusals."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from pathlib import Path

import pytest
from sqlalchemy import insert

from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.routing.policy_manager import PolicyManager
from specgate.gateway.settings import PolicySettings
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.policy_store import MemoryPolicyStore, SqlPolicyStore
from specgate.gateway.telemetry.tables import requests
from tests.policies import synthetic_telemetry as synth


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 't.db'}"
    schema.upgrade(url)
    eng = schema.make_engine(url)
    yield eng
    eng.dispose()


def seed(engine, n: int) -> None:  # type: ignore[no-untyped-def]
    synth.insert(engine, n, seed=2)
    with engine.begin() as conn:
        # Rows the learner must skip: failed, too short, routed before the policy (no arm).
        base = dict(
            endpoint="chat", model="m", stream=False, received_at=dt.datetime.now(dt.UTC), cancelled=False
        )
        ok = dict(status=200, outcome="ok", tokens_per_s=5.0, features={"p_code": 1.0}, **base)
        skipped = [
            dict(request_id="e", status=500, outcome="error", **base),
            {**ok, "request_id": "s", "completion_tokens": 1, "route": {"arm": "embedded:off"}},
            {**ok, "request_id": "n", "completion_tokens": 50, "route": {"backend": "x"}},
        ]
        for row in skipped:
            conn.execute(insert(requests).values(**row))


def test_fresh_install_then_warm_start(engine) -> None:  # type: ignore[no-untyped-def]
    first = PolicyManager(PolicySettings(), SqlPolicyStore(engine), persistent=True)
    first.load()
    assert first.version == 1 and first.state.kind == "rules"
    seed(engine, 400)
    assert len(SqlPolicyStore(engine).training_rows(time.time() - 3600)) == 400
    result = asyncio.run(first.retrain())
    assert result["promoted"] and first.version == 2 and first.state.kind == "learned"
    again = PolicyManager(PolicySettings(), SqlPolicyStore(engine), persistent=True)
    again.load()
    assert again.version == 2 and again.state.kind == "learned"
    assert sorted(again.state.model.arms) == ["embedded:ngram", "embedded:off"]  # type: ignore[union-attr]


def test_retrain_refusals(engine) -> None:  # type: ignore[no-untyped-def]
    manager = PolicyManager(PolicySettings(), SqlPolicyStore(engine), persistent=True)
    manager.load()
    with pytest.raises(GatewayError) as err:
        asyncio.run(manager.retrain())
    assert err.value.status == 409 and err.value.code == "insufficient_telemetry"
    memory = PolicyManager(PolicySettings(), MemoryPolicyStore(), persistent=False)
    memory.load()
    with pytest.raises(GatewayError) as err:
        asyncio.run(memory.retrain())
    assert err.value.code == "no_telemetry"
    assert [v["source"] for v in memory.versions()] == ["default"]


def test_scheduled_retrain_promotes_without_an_operator(engine) -> None:  # type: ignore[no-untyped-def]
    seed(engine, 400)
    manager = PolicyManager(PolicySettings(retrain_interval=0.05), SqlPolicyStore(engine), persistent=True)
    manager.load()

    async def run() -> None:
        manager.start()
        deadline = time.monotonic() + 30
        while manager.state.kind != "learned" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await manager.close()

    asyncio.run(run())
    assert manager.state.kind == "learned"
    assert manager.versions()[-1]["source"] == "default"
