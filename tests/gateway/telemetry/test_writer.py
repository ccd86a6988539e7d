"""The writer: batched idempotent inserts, spooling while the database is down, replay, no loss."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from gateway.records import RequestRecord
from gateway.telemetry import schema
from gateway.telemetry.spool import Spool
from gateway.telemetry.tables import requests, spec_steps
from gateway.telemetry.writer import TelemetryWriter
from tests.gateway.telemetry.tcp_proxy import behind_proxy


def record(i: int, **kw: object) -> RequestRecord:
    rec = RequestRecord(f"req-{i}", "chat", "m", received_at=time.time() - 1, stream=False, **kw)  # type: ignore[arg-type]
    rec.status, rec.backend = 200, "embedded"
    rec.route = {
        "backend": "embedded",
        "spec": {"method": "ngram", "controller": "goodput", "k_min": 0, "k_max": 8},
    }
    rec.prompt_tokens, rec.completion_tokens = 10, 20
    rec.first_token_at = rec.received_at + 0.05
    rec.spec = {
        "method": "ngram",
        "num_drafts": 5,
        "num_draft_tokens": 15,
        "num_accepted_tokens": 9,
        "acceptance_counts": [5, 3, 1],
        "mean_acceptance_length": 2.8,
        "draft_acceptance_rate": 0.6,
    }
    rec.spec_steps = [(3, 2, 7, 12.5), (3, 1, 7, 11.0)]
    rec.load = {"queue_depth": 1, "running": 3, "kv_usage": 0.25, "backend_in_flight": {"embedded": 2}}
    rec.finish()
    return rec


def count(url: str, table=requests) -> int:  # type: ignore[no-untyped-def]
    engine = schema.make_engine(url)
    with engine.connect() as conn:
        n = conn.execute(select(func.count()).select_from(table)).scalar_one()
    engine.dispose()
    return int(n)


def writer_for(url: str, spool: Path, **kw: object) -> TelemetryWriter:
    w = TelemetryWriter(schema.make_engine(url), Spool(spool), flush_interval=0.02, retry_interval=0.1, **kw)  # type: ignore[arg-type]
    w.start()
    return w


def test_rows_are_written_with_their_fields(db_url: str, tmp_path: Path) -> None:
    schema.upgrade(db_url)
    w = writer_for(db_url, tmp_path / "spool.jsonl", step_sample_rate=1.0)
    for i in range(300):
        w.submit(record(i))
    w.submit(record(0))  # the same request id again: still one row
    assert w.flush()
    w.close()
    assert count(db_url) == 300 and count(db_url, spec_steps) == 600
    assert w.counters.written == 301 and w.counters.spooled == w.counters.dropped == 0
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        row = conn.execute(select(requests).where(requests.c.request_id == "req-7")).mappings().one()
    engine.dispose()
    assert row["spec_method"] == "ngram" and row["spec_controller"] == "goodput" and row["k_max"] == 8
    assert row["num_accepted_draft_tokens"] == 9 and row["acceptance_histogram"] == [5, 3, 1]
    assert row["load_backend_in_flight"] == 2 and row["load_kv_usage"] == 0.25
    assert row["ttft_ms"] == pytest.approx(50, abs=1) and row["outcome"] == "ok" and not row["cancelled"]
    assert row["received_at"].tzinfo is not None or db_url.startswith("sqlite")


def test_spec_steps_are_off_by_default(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    w = writer_for(sqlite_url, tmp_path / "spool.jsonl")
    w.submit(record(1))
    w.flush()
    w.close()
    assert count(sqlite_url) == 1 and count(sqlite_url, spec_steps) == 0


def test_database_down_during_a_burst_loses_nothing(pg_url: str, tmp_path: Path) -> None:
    schema.upgrade(pg_url)
    proxy, via_proxy = behind_proxy(pg_url)
    w = writer_for(via_proxy, tmp_path / "spool.jsonl", batch_size=16)
    for i in range(100):
        w.submit(record(i))
    assert w.flush()
    proxy.stop()  # the database disappears mid-burst
    for i in range(100, 400):
        w.submit(record(i))
        if i % 50 == 0:
            time.sleep(0.05)
    assert w.flush()
    assert w.counters.spooled > 0 and not w.db_up
    assert count(pg_url) < 400
    proxy = proxy.restarted()  # it comes back
    for i in range(400, 450):
        w.submit(record(i))
    deadline = time.monotonic() + 15
    while count(pg_url) < 450 and time.monotonic() < deadline:
        time.sleep(0.1)
    w.close()
    proxy.stop()
    assert count(pg_url) == 450  # every request exactly once (request_id is the primary key)
    assert w.counters.dropped == 0 and w.counters.replayed == w.counters.spooled
    assert w.spool.empty()


def test_restart_with_a_spool_replays_it(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    spool_path = tmp_path / "spool.jsonl"
    down = writer_for("postgresql+psycopg://nobody@127.0.0.1:1/none", spool_path)  # a closed port
    for i in range(50):
        down.submit(record(i))
    assert down.flush()
    down.close()
    assert len(Spool(spool_path)) == 50 and down.counters.spooled == 50
    with spool_path.open("a") as f:
        f.write('{"r": {"request_id": "torn')  # a crash mid-line is skipped, not fatal
    up = writer_for(sqlite_url, spool_path)  # the next start, with the database reachable
    deadline = time.monotonic() + 10
    while not up.spool.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
    up.close()
    assert count(sqlite_url) == 50 and up.counters.replayed == 50 and up.spool.empty()


def test_sqlite_parallel_writers(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    writers = [writer_for(sqlite_url, tmp_path / f"spool{i}.jsonl", batch_size=8) for i in range(4)]

    def burst(w: TelemetryWriter, base: int) -> None:
        for i in range(200):
            w.submit(record(base + i))

    threads = [threading.Thread(target=burst, args=(w, k * 1000)) for k, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        assert w.flush()
        w.close()
    assert count(sqlite_url) == 800
    assert sum(w.counters.spooled for w in writers) == 0


def test_a_full_queue_spills_to_disk_instead_of_dropping(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    w = TelemetryWriter(
        schema.make_engine(sqlite_url), Spool(tmp_path / "s.jsonl"), max_queue=5, retry_interval=0.05
    )
    for i in range(20):  # the writer thread is not started yet: the queue fills
        w.submit(record(i))
    assert w.counters.spooled == 15 and w.counters.dropped == 0
    w.start()
    deadline = time.monotonic() + 10
    while count(sqlite_url) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    assert count(sqlite_url) == 20


def test_spool_failure_is_counted_as_dropped(sqlite_url: str, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the spool's directory should be")
    w = TelemetryWriter(
        schema.make_engine("postgresql+psycopg://x@127.0.0.1:1/none"), Spool(tmp_path / "ok.jsonl")
    )
    w.spool.path = blocked / "spool.jsonl"
    w.start()
    w.submit(record(1))
    assert w.flush()
    w.close()
    assert w.counters.dropped == 1
