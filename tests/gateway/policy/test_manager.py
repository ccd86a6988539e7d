"""PolicyManager over a real SQLite database: fresh install, warm start, scheduled retrain, refusals;
several managers on one database (SQLite, PostgreSQL) following each other's changes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
from pathlib import Path

import pytest
from sqlalchemy import insert, text

from specgate.gateway.policy.manager import PolicyManager
from specgate.gateway.policy.store import MemoryPolicyStore, SqlPolicyStore
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.settings import PolicySettings
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests, spec_steps
from tests.gateway.pg import postgres_database
from tests.policies import synthetic_telemetry as synth


@contextlib.contextmanager
def database(kind: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """An engine on a migrated database: a SQLite file, or a fresh one on the machine's PostgreSQL."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 't.db'}"
        schema.upgrade(url)
        eng = schema.make_engine(url)
        try:
            yield eng
        finally:
            eng.dispose()
        return
    with postgres_database() as url:
        eng = schema.make_engine(url)
        try:
            yield eng
        finally:
            eng.dispose()


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    with database("sqlite", tmp_path) as eng:
        yield eng


@pytest.fixture(params=["sqlite", "postgresql"])
def shared(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A database several gateways share."""
    with database(request.param, tmp_path) as eng:
        yield eng


def gateway(engine, **settings: float) -> PolicyManager:  # type: ignore[no-untyped-def]
    """A loaded manager on `engine`'s database, as each gateway (or worker) holds one."""
    manager = PolicyManager(PolicySettings(**settings), SqlPolicyStore(engine), persistent=True)
    manager.load()
    return manager


def seed(engine, n: int) -> None:  # type: ignore[no-untyped-def]
    synth.insert(engine, n, seed=2)
    with engine.begin() as conn:
        # Rows the learner must skip: failed, too short, routed before the policy (no arm).
        base = dict(
            endpoint="chat", model="m", stream=False, arrival_time=dt.datetime.now(dt.UTC), cancelled=False
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
    first = gateway(engine)
    assert first.version == 1 and first.state.kind == "rules"
    seed(engine, 400)
    assert len(SqlPolicyStore(engine).training_rows(time.time() - 3600)) == 400
    result = asyncio.run(first.retrain())
    assert result["promoted"] and first.version == 2 and first.state.kind == "learned"
    again = gateway(engine)
    assert again.version == 2 and again.state.kind == "learned"
    assert sorted(again.state.model.arms) == ["embedded:ngram", "embedded:off"]  # type: ignore[union-attr]


def test_retrain_refusals(engine) -> None:  # type: ignore[no-untyped-def]
    manager = gateway(engine)
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
    manager = gateway(engine, retrain_interval=0.05)

    async def run() -> None:
        manager.start()
        deadline = time.monotonic() + 30
        while manager.state.kind != "learned" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await manager.close()

    asyncio.run(run())
    assert manager.state.kind == "learned"
    assert manager.versions()[-1]["source"] == "default"


def _edit(manager: PolicyManager, min_confidence: float) -> None:
    rules = dataclasses.replace(manager.state.rules, min_confidence=min_confidence)
    asyncio.run(manager.update_rules(rules, note="edited elsewhere"))


def test_policy_edits_reach_every_gateway_on_one_database(shared) -> None:  # type: ignore[no-untyped-def]
    """Two gateways (or two workers) on one database: a change made through either is live in both."""
    a, b = gateway(shared, sync_interval=0.05), gateway(shared, sync_interval=0.05)
    assert a.version == b.version == 1
    assert not asyncio.run(b.sync())  # nothing changed: nothing reinstalled
    _edit(a, 0.7)
    assert a.version == 2 and b.version == 1
    assert asyncio.run(b.sync()) and b.version == 2 and b.state.rules.min_confidence == 0.7
    _edit(b, 0.8)  # b's edit is on top of what a made
    assert b.version == 3

    async def follow_a_rollback() -> None:
        a.start(retrain=False)  # the poll, in the background
        await b.rollback(2)
        deadline = time.monotonic() + 5
        while a.version != b.version and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await a.close()

    asyncio.run(follow_a_rollback())
    assert a.version == b.version == 4 and a.state.rules.min_confidence == 0.7


def test_a_database_that_goes_away_does_not_stop_routing(engine) -> None:  # type: ignore[no-untyped-def]
    manager = gateway(engine, sync_interval=0.02)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE policy_versions"))

    async def run() -> None:
        manager.start(retrain=False)
        await asyncio.sleep(0.2)  # the poll fails a few times, quietly
        assert all(not t.done() for t in manager._tasks)
        await manager.close()

    asyncio.run(run())
    assert manager.version == 1


def test_sync_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PolicySettings(sync_interval=0)


def test_one_retrain_at_a_time_on_one_database(shared) -> None:  # type: ignore[no-untyped-def]
    """Two gateways on one database: while one holds the retrain lease, the other's retrain is a
    409 that says so, and retraining works again once it is released."""
    seed(shared, 400)
    a, b = gateway(shared), gateway(shared)
    lease = a.store.retrain_lease()
    assert lease is not None
    try:
        assert b.store.retrain_lease() is None
        with pytest.raises(GatewayError) as err:
            asyncio.run(b.retrain())
        assert err.value.status == 409 and err.value.code == "retrain_in_progress"
        assert [v["source"] for v in b.versions()] == ["default"]  # nothing was fitted or stored
    finally:
        lease.release()
    result = asyncio.run(b.retrain())
    assert result["promoted"] and b.version == 2
    assert asyncio.run(a.sync()) and a.version == 2
    again = b.store.retrain_lease()  # released after the retrain, also when it succeeded
    assert again is not None
    again.release()


def test_scheduled_retrains_skip_a_round_another_gateway_did(engine) -> None:  # type: ignore[no-untyped-def]
    seed(engine, 400)
    a = gateway(engine, retrain_interval=3600.0)
    assert not a._retrained_recently()
    asyncio.run(a.retrain())
    b = gateway(engine, retrain_interval=3600.0)
    assert b._retrained_recently()  # a's retrain counts for this hour's round
    assert not PolicyManager(PolicySettings(retrain_interval=0.001), b.store, True)._retrained_recently()


def test_retrain_measures_the_step_cost_from_spec_steps(engine) -> None:  # type: ignore[no-untyped-def]
    """The engine's per-step rows (batch tokens, step ms) become the policy's step cost curve, and
    the admin view says from which batch each class's speculation stops paying."""
    seed(engine, 400)
    with engine.begin() as conn:
        ids = [
            r[0] for r in conn.execute(text("SELECT request_id FROM requests ORDER BY request_id LIMIT 40"))
        ]
        rows = [
            {
                "request_id": rid,
                "step_index": i,
                "k_proposed": 4,
                "accepted": 2,
                "batch_tokens": n,
                "step_ms": 10 + 0.5 * n,
            }
            for rid in ids
            for i, n in enumerate((1, 4, 16, 64))
        ]
        conn.execute(insert(spec_steps), rows)
    store = SqlPolicyStore(engine)
    assert sorted(set(store.step_rows(time.time() - 3600))) == [(n, 10 + 0.5 * n) for n in (1, 4, 16, 64)]
    assert store.step_rows(time.time() + 60) == []  # only the window's requests
    manager = PolicyManager(PolicySettings(), store, persistent=True)
    manager.load()
    asyncio.run(manager.retrain())
    assert manager.state.step_cost is not None and manager.state.step_cost.n_steps == 160
    view = manager.describe()["step_cost"]
    assert view["crossover_batch"]["code:ngram"] is not None and view["crossover_batch"]["code:ngram"] > 1
    # Per temperature band too (the synthetic rows are greedy), beside the pooled prior.
    priors = manager.describe()["acceptance_priors"]
    assert {"code:ngram", "code:ngram@t0"} <= set(priors) and "code:ngram@t0" in view["crossover_batch"]


def test_a_whole_answers_latency_equal_to_its_whole_time_is_not_trained_on(engine) -> None:  # type: ignore[no-untyped-def]
    """Rows from before external backends' own timings were read recorded a non-streamed answer's
    TTFT as its whole time (and a TPOT near 0): unknown, not measurements."""
    now = dt.datetime.now(dt.UTC)
    base = dict(
        endpoint="chat", model="m", arrival_time=now, cancelled=False, status=200, outcome="ok",
        tokens_per_s=5.0, completion_tokens=50, features={"p_code": 1.0}, route={"arm": "vllm:upstream"},
    )  # fmt: skip
    rows = [
        {**base, "request_id": "old", "stream": False, "ttft_ms": 1000.0, "e2e_ms": 1000.0, "tpot_ms": 0.01},
        {**base, "request_id": "timed", "stream": False, "ttft_ms": 80.0, "e2e_ms": 1000.0, "tpot_ms": 18.0},
        {
            **base,
            "request_id": "streamed",
            "stream": True,
            "ttft_ms": 999.0,
            "e2e_ms": 1000.0,
            "tpot_ms": 0.02,
        },
    ]
    with engine.begin() as conn:
        for row in rows:
            conn.execute(insert(requests).values(**row))
    got = {(r.ttft_ms, r.tpot_ms) for r in SqlPolicyStore(engine).training_rows(time.time() - 3600)}
    assert got == {(None, None), (80.0, 18.0), (999.0, 0.02)}
