"""Replica affinity through a live gateway: three scripted upstreams declared as one replica group.

Each upstream answers with its own text, so the tests see which replica served; the openai client
sends the requests, `metrics.route.affinity` and the telemetry rows say what the gateway decided.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.gateway.fake_upstream import FakeUpstream, backend, metric_value, openai_client, running_gateway
from tests.gateway.live import LiveGateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

MODEL = "pooled-model"
NAMES = ("p0", "p1", "p2")


@pytest.fixture
def replicas() -> Iterator[dict[str, FakeUpstream]]:
    fakes = {n: FakeUpstream(models=(f"{n}-model",), text=f"replica {n}").start() for n in NAMES}
    try:
        yield fakes
    finally:
        for fake in fakes.values():
            fake.stop()


def pool(replicas: dict[str, FakeUpstream], db: str, **kw: Any) -> Any:
    return running_gateway(
        *(backend(n, f, models={MODEL: f"{n}-model"}, replica_group="pool") for n, f in replicas.items()),
        telemetry={"url": db, "auto_upgrade": True, "flush_interval": 0.05},
        **kw,
    )


def ask(
    live: LiveGateway, messages: list[dict[str, str]], user: str | None = None
) -> tuple[str, dict[str, Any]]:
    extra = {"user": user} if user is not None else {}
    resp = openai_client(live).chat.completions.create(model=MODEL, messages=messages, **extra)  # type: ignore[arg-type]
    route = (resp.model_extra or {})["metrics"]["route"]
    return route["backend"], route


def live_metrics(live: LiveGateway) -> str:
    return httpx.get(f"{live.url}/metrics", timeout=10, trust_env=False).text


def rows(db: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(db)
    try:
        with engine.connect() as conn:
            columns = "backend, affinity_group, affinity_source, affinity_hit"
            sql = f"SELECT {columns} FROM requests ORDER BY arrival_time"
            return [dict(r._mapping) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def test_conversations_stick_to_one_replica_and_spread_across_the_group(
    replicas: dict[str, FakeUpstream], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/t.db"
    with pool(replicas, db) as live:
        homes: dict[str, str] = {}
        for rnd in range(3):
            for i in range(12):
                served, route = ask(live, [{"role": "user", "content": f"round {rnd}"}], user=f"user-{i}")
                assert homes.setdefault(f"user-{i}", served) == served  # the same replica every time
                aff = route["affinity"]
                assert aff["group"] == "pool" and aff["source"] == "user" and aff["hit"] is True
        assert len(set(homes.values())) >= 2  # twelve conversations do not all land on one replica

        # Without a `user`, a conversation is known by its opening: turn 2 goes where turn 1 went.
        opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan a trip."}]
        first, route = ask(live, opening)
        assert route["affinity"]["source"] == "prefix"
        follow_up = [
            *opening,
            {"role": "assistant", "content": "Rome."},
            {"role": "user", "content": "And then?"},
        ]
        assert ask(live, follow_up)[0] == first
        metrics = live_metrics(live)
        assert metric_value(metrics, "specgate_affinity_requests_total", group="pool", result="hit") == 38
    written = rows(db)
    assert len(written) == 38
    assert all(r["affinity_group"] == "pool" and r["affinity_hit"] for r in written)
    assert {r["affinity_source"] for r in written} == {"user", "prefix"}


def test_a_replica_that_goes_away_hands_its_conversations_on(
    replicas: dict[str, FakeUpstream], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path}/t.db"
    messages = [{"role": "user", "content": "hello"}]
    with pool(replicas, db) as live:
        home, _ = ask(live, messages, user="bob")
        replicas[home].stop()
        served, route = ask(live, messages, user="bob")  # fails over within the group
        assert served != home and route["affinity"]["home"] == home and route["affinity"]["hit"] is False
        metrics = live_metrics(live)
        assert metric_value(metrics, "specgate_affinity_requests_total", group="pool", result="miss") == 1
    written = rows(db)
    assert [r["affinity_hit"] for r in written] == [True, False]
    assert written[1]["backend"] == served
