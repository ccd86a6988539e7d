"""Through a live gateway: one row per request, whatever happens to the database meanwhile."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from specgate.bench.tcp_proxy import behind_proxy
from specgate.gateway.cli.main import main
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.tables import requests
from tests.gateway.live import TEST_ADMIN_KEY, readiness, start_gateway, tiny_settings


def rows(url: str) -> dict[str, dict]:
    """Rows by the client's x-request-id (the tests send unique ones; the key is the gateway's id)."""
    engine = schema.make_engine(url)
    with engine.connect() as conn:
        out = {r["client_request_id"]: dict(r) for r in conn.execute(select(requests)).mappings()}
    engine.dispose()
    return out


@pytest.mark.slow
def test_every_request_leaves_exactly_one_row_across_a_database_outage(
    pg_url: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    schema.upgrade(pg_url)
    proxy, via_proxy = behind_proxy(pg_url)
    telemetry = {
        "url": via_proxy,
        "spool_dir": str(tmp_path / "spool"),
        "flush_interval": 0.02,
        "retry_interval": 0.1,
        "spec_steps_sample_rate": 1.0,
    }
    live = start_gateway(tiny_settings(str(tiny_llama_dir), telemetry=telemetry, admin_key=TEST_ADMIN_KEY))
    model = tiny_llama_dir.name

    def call(i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"n{i} abab abab"}],
            "max_tokens": 4,
            "spec": {"method": "ngram"},
        }
        if i % 7 == 3:
            body["temperature"] = 9  # an invalid request still leaves a row
        r = httpx.post(
            f"{live.url}/v1/chat/completions", json=body, headers={"x-request-id": f"burst-{i}"}, timeout=60
        )
        return r.status_code

    try:
        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(call, range(40)))
            proxy.stop()  # PostgreSQL goes away in the middle of the burst
            second = list(pool.map(call, range(40, 100)))
            ready = readiness(live.url)
            assert ready["checks"]["store"]["ok"] is False
            assert "backlog" in ready["checks"]["store"]["detail"]
            assert "quarantined 0" in ready["checks"]["store"]["detail"]
            assert "specgate_telemetry_spool_backlog" in httpx.get(f"{live.url}/metrics").text
            proxy = proxy.restarted()
            third = list(pool.map(call, range(100, 120)))
        statuses = first + second + third
        assert statuses.count(400) == sum(1 for i in range(120) if i % 7 == 3)
        assert set(statuses) == {200, 400}
        writer = live.services.store.writer  # type: ignore[union-attr]
        deadline = time.monotonic() + 20
        while len(rows(pg_url)) < 120 and time.monotonic() < deadline:
            time.sleep(0.1)
        metrics = httpx.get(f"{live.url}/metrics").text
    finally:
        live.stop()
        proxy.stop()
    got = rows(pg_url)
    assert sorted(got) == sorted(f"burst-{i}" for i in range(120))
    assert writer.counters.spooled > 0 and writer.counters.dropped == 0
    assert (
        "specgate_telemetry_rows_spooled_total" in metrics
        and "specgate_telemetry_rows_dropped_total 0.0" in metrics
        and "specgate_telemetry_rows_quarantined_total 0.0" in metrics
    )
    ok = got["burst-0"]
    assert ok["status"] == 200 and ok["backend"] == "embedded" and ok["completion_tokens"] == 4
    assert ok["spec_method"] == "ngram" and ok["e2e_ms"] > 0
    assert ok["cached_tokens"] is not None and 0 <= ok["cached_tokens"] <= ok["prompt_tokens"]
    # The request pinned its speculation; the policy still classified it and named its version.
    assert ok["policy"] == "request" and ok["policy_version"] == "1" and ok["workload_class"] is not None
    assert ok["route"]["arm"] == "embedded:ngram" and "load_running" in ok["features"]
    bad = got["burst-3"]
    assert bad["status"] == 400 and bad["outcome"] == "error" and bad["error_code"] == "invalid_value"
    assert bad["cached_tokens"] is None  # never reached a backend


def test_prefix_cache_hits_reach_the_row(sqlite_url: str, tiny_llama_dir: Path) -> None:
    schema.upgrade(sqlite_url)
    telemetry = {"url": sqlite_url, "flush_interval": 0.02}
    live = start_gateway(tiny_settings(str(tiny_llama_dir), telemetry=telemetry, log_requests=False))
    body = {
        "model": tiny_llama_dir.name,
        "messages": [{"role": "user", "content": "Cache me: one two three four five six seven. " * 3}],
        "max_tokens": 3,
    }
    told = []
    try:
        for rid in ("cache-row-1", "cache-row-2"):
            r = httpx.post(
                f"{live.url}/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=60
            )
            assert r.status_code == 200, r.text
            told.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    finally:
        live.stop()  # flushes every queued row
    got = rows(sqlite_url)
    assert [got[rid]["cached_tokens"] for rid in ("cache-row-1", "cache-row-2")] == told
    assert told[0] == 0 and 0 < told[1] <= got["cache-row-2"]["prompt_tokens"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's exit
def test_gateway_refuses_an_outdated_postgres_schema(pg_url: str, tiny_llama_dir: Path) -> None:
    settings = tiny_settings(str(tiny_llama_dir), telemetry={"url": pg_url})
    with pytest.raises(RuntimeError):
        start_gateway(settings, timeout=30)
    assert schema.current_revision(schema.make_engine(pg_url)) is None  # not migrated behind our back


def test_serve_preflight_names_the_command(pg_url: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SPECGATE_TELEMETRY__URL", pg_url)
    assert main(["serve", "--port", "1"]) == 2
    assert "specgate db upgrade" in capsys.readouterr().err


def _chat(url: str, model: str, rid: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"x-request-id": rid}, timeout=60
    ).status_code


@pytest.mark.slow
def test_shutdown_flushes_and_a_restart_replays_the_spool(
    pg_url: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    schema.upgrade(pg_url)
    proxy, via_proxy = behind_proxy(pg_url)
    spool = tmp_path / "spool"
    # A slow flush interval: rows are still queued when the gateway is told to stop.
    telemetry = {
        "url": via_proxy,
        "spool_dir": str(spool),
        "flush_interval": 5.0,
    }
    live = start_gateway(tiny_settings(str(tiny_llama_dir), telemetry=telemetry))
    model = tiny_llama_dir.name
    assert [_chat(live.url, model, f"flush-{i}") for i in range(5)] == [200] * 5
    live.stop()  # graceful shutdown writes what is queued
    assert sorted(rows(pg_url)) == [f"flush-{i}" for i in range(5)]

    live = start_gateway(tiny_settings(str(tiny_llama_dir), telemetry={**telemetry, "flush_interval": 0.02}))
    proxy.stop()  # the database goes away: these rows can only reach the spool
    assert [_chat(live.url, model, f"spooled-{i}") for i in range(5)] == [200] * 5
    live.stop()
    assert not [r for r in rows(pg_url) if r.startswith("spooled")]
    left = list(spool.glob("spool-*.jsonl"))  # the stopped process's file, its lock released
    assert len(left) == 1 and left[0].stat().st_size > 0

    proxy = proxy.restarted()
    live = start_gateway(tiny_settings(str(tiny_llama_dir), telemetry=telemetry))  # restart: adopts it
    deadline = time.monotonic() + 15
    while len(rows(pg_url)) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    live.stop()
    proxy.stop()
    assert sorted(rows(pg_url)) == sorted(
        [f"flush-{i}" for i in range(5)] + [f"spooled-{i}" for i in range(5)]
    )
    assert list(spool.glob("spool-*.jsonl")) == []


@pytest.mark.slow
def test_a_record_keeps_the_load_its_route_was_decided_on(tiny_llama_dir: Path) -> None:
    """While one long stream runs, the next request's record says so: the engine's batch, and one
    request of this gateway in flight on the embedded backend (its row's load columns)."""

    from specgate.gateway.telemetry.rows import request_row
    from tests.gateway.live import record_of, wait_for

    live = start_gateway(tiny_settings(str(tiny_llama_dir)))
    model = tiny_llama_dir.name
    long = {
        "model": model,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        embedded = live.services.registry.embedded
        assert embedded is not None and embedded.load().in_flight == 0
        # The long stream is read here, so it is still running (hundreds of steps from its end)
        # when the short request arrives beside it.
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=long, timeout=120) as streaming:
            lines = streaming.iter_lines()
            assert any(line.startswith("data: ") for line in lines)
            assert embedded.load().in_flight == 1
            short = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            r = httpx.post(
                f"{live.url}/v1/chat/completions", json=short, headers={"x-request-id": "beside"}, timeout=60
            )
            assert r.status_code == 200
            rec = record_of(live, "beside")
            assert rec is not None and rec.load is not None and rec.load.engine is not None
            assert rec.load.backends["embedded"].in_flight == 1 and rec.load.engine.num_running >= 1
            row = request_row(rec)
            assert row["load_backend_in_flight"] == 1 and row["load_running"] == rec.load.engine.num_running
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert wait_for(lambda: embedded.load().in_flight == 0, 30)
    finally:
        live.stop()
