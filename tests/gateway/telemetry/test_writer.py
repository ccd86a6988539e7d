"""The writer: batched idempotent inserts, spooling while the database is down, replay, no loss."""

from __future__ import annotations

import dataclasses
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from specgate.bench.tcp_proxy import behind_proxy
from specgate.engine.vocab import LoadSnapshot, SpecParams, SpecStep
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry import writer as writer_module
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.rows import request_row
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.tables import requests, spec_steps, telemetry_quarantine
from specgate.gateway.telemetry.writer import TelemetryWriter
from specgate.policies.load import BackendLoad, Load


def record(i: int, **kw: Any) -> RequestRecord:
    route = RouteDecision("m", ["embedded"], SpecParams("ngram", "goodput", 0, 8))
    route = route.served_by("embedded", external=False)
    received = time.time() - 1
    spec = {
        "method": "ngram",
        "num_drafts": 5,
        "num_draft_tokens": 15,
        "num_accepted_tokens": 9,
        "num_accepted_tokens_per_pos": [5, 3, 1],
        "mean_acceptance_length": 2.8,
        "draft_acceptance_rate": 0.6,
        "num_tree_drafts": 1,
        "mean_draft_nodes": 3.0,
    }
    fields: dict[str, Any] = {
        "status": 200,
        "backend": "embedded",
        "route": route,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "cached_tokens": 4,
        "first_token_time": received + 0.05,
        "finished_time": time.time(),
        "spec_decoding": spec,
        "spec_steps": [
            SpecStep(3, 2, 7, 12.5, 3),
            SpecStep(3, 1, 7, 11.0, 2),
        ],  # the second a tree of 3 nodes, 2 deep
        "load": Load(
            LoadSnapshot(num_waiting=1, num_running=3, kv_cache_usage=0.25), {"embedded": BackendLoad(2)}
        ),
    }
    return RequestRecord(f"req-{i}", "chat", "m", arrival_time=received, stream=False, **(fields | kw))


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
    w = writer_for(db_url, tmp_path / "spool", step_sample_rate=1.0)
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
        steps = conn.execute(
            select(spec_steps.c.k_proposed, spec_steps.c.accepted, spec_steps.c.depth)
            .where(spec_steps.c.request_id == "req-7")
            .order_by(spec_steps.c.step_index)
        ).all()
    engine.dispose()
    assert [tuple(s) for s in steps] == [(3, 2, 3), (3, 1, 2)]
    assert row["num_tree_drafts"] == 1 and row["mean_draft_nodes"] == 3.0
    assert row["spec_method"] == "ngram" and row["spec_controller"] == "goodput" and row["k_max"] == 8
    assert row["num_accepted_tokens"] == 9 and row["num_accepted_tokens_per_pos"] == [5, 3, 1]
    assert row["load_backend_in_flight"] == 2 and row["load_kv_usage"] == 0.25
    assert row["prompt_tokens"] == 10 and row["cached_tokens"] == 4
    assert row["ttft_ms"] == pytest.approx(50, abs=1) and row["outcome"] == "ok" and not row["cancelled"]
    assert row["arrival_time"].tzinfo is not None or db_url.startswith("sqlite")


def test_spec_steps_are_off_by_default(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    w = writer_for(sqlite_url, tmp_path / "spool")
    w.submit(record(1))
    w.flush()
    w.close()
    assert count(sqlite_url) == 1 and count(sqlite_url, spec_steps) == 0


@pytest.mark.slow
def test_database_down_during_a_burst_loses_nothing(pg_url: str, tmp_path: Path) -> None:
    schema.upgrade(pg_url)
    proxy, via_proxy = behind_proxy(pg_url)
    w = writer_for(via_proxy, tmp_path / "spool", batch_size=16)
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
    spool_dir = tmp_path / "spool"
    down = writer_for("postgresql+psycopg://nobody@127.0.0.1:1/none", spool_dir)  # a closed port
    for i in range(50):
        down.submit(record(i))
    assert down.flush()
    down.close()  # releases its lock; the file with its rows stays
    assert down.counters.spooled == 50
    [left] = spool_dir.glob("spool-*.jsonl")
    assert sum(1 for _ in left.open()) == 50
    with left.open("a") as f:
        f.write('{"r": {"request_id": "torn')  # a crash mid-line is skipped, not fatal
    up = writer_for(sqlite_url, spool_dir)  # the next start, with the database reachable: adopts it
    deadline = time.monotonic() + 10
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    up.close()
    assert count(sqlite_url) == 50 and up.counters.replayed == 50 and up.counters.adopted == 1
    assert list(spool_dir.glob("spool-*.jsonl")) == []


def _locked() -> OperationalError:
    return OperationalError("INSERT INTO requests ...", {}, sqlite3.OperationalError("database is locked"))


@pytest.mark.parametrize(("failures", "spooled"), [(3, 0), (4, 5)])
def test_a_lost_lock_is_retried_before_rows_spool(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int, spooled: int
) -> None:
    # SQLite may answer "database is locked" at once, whatever its busy timeout: up to
    # TRANSIENT_RETRIES such answers in a row are a lock lost to another writer, not an outage.
    schema.upgrade(sqlite_url)
    monkeypatch.setattr(writer_module, "TRANSIENT_PAUSE", 0.001)
    w = writer_for(sqlite_url, tmp_path / "spool", batch_size=8)
    real = w._insert_entries
    left = [failures]

    def flaky(entries: list) -> None:  # type: ignore[type-arg]
        if left[0] > 0:
            left[0] -= 1
            raise _locked()
        real(entries)

    monkeypatch.setattr(w, "_insert_entries", flaky)
    for i in range(5):
        w.submit(record(i))
    assert w.flush()
    w.close()
    assert count(sqlite_url) == 5  # nothing lost either way
    assert w.counters.spooled == spooled
    assert w.counters.db_errors == (1 if spooled else 0)


def test_sqlite_parallel_writers(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    writers = [writer_for(sqlite_url, tmp_path / f"spool{i}", batch_size=8) for i in range(4)]

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
        schema.make_engine(sqlite_url), Spool(tmp_path / "spool"), max_queue=5, retry_interval=0.05
    )
    for i in range(20):  # the writer thread is not started yet: the queue fills
        w.submit(record(i))
    # submit() runs on the event loop: it never touches the disk, the overflow waits in memory.
    assert w.queue_size() == 20 and w.counters.spooled == 0 and not w.spool.path.exists()
    w.start()
    deadline = time.monotonic() + 10
    while count(sqlite_url) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    assert count(sqlite_url) == 20 and w.counters.spooled == 15 and w.counters.dropped == 0


def test_spool_failure_is_counted_as_dropped(sqlite_url: str, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the spool's directory should be")
    w = TelemetryWriter(schema.make_engine("postgresql+psycopg://x@127.0.0.1:1/none"), Spool(tmp_path / "ok"))
    w.spool.directory, w.spool.path = blocked, blocked / "spool.jsonl"
    w.start()
    w.submit(record(1))
    assert w.flush()
    w.close()
    assert w.counters.dropped == 1


def test_values_are_fitted_to_their_columns(db_url: str, tmp_path: Path) -> None:
    """What once jammed the writer (a lone surrogate, NUL, huge or non-finite numbers, overlong
    strings, odd JSON) lands, fitted."""
    schema.upgrade(db_url)
    w = writer_for(db_url, tmp_path / "spool")
    rec = record(
        1,
        client_request_id="c" * 500,
        prompt_tokens=10**30,
        completion_tokens=-(10**30),
        queue_time_ms=float("nan"),
        upstream={"big": "y" * 200_000},
    )
    assert rec.route is not None
    features = {
        "x": float("inf"),
        "\udfff": ["\ud800", 2**70],
        "deep": [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]],
    }
    route = dataclasses.replace(rec.route, features=features)
    rec = dataclasses.replace(rec, model="\ud800bad\x00" + "m" * 1000, route=route)
    w.submit(rec)
    assert w.flush()
    w.close()
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        row = conn.execute(select(requests)).mappings().one()
    engine.dispose()
    assert w.counters.quarantined == 0 and w.counters.written == 1
    assert row["model"].startswith("?bad") and len(row["model"]) == 256 and "\x00" not in row["model"]
    assert len(row["client_request_id"]) == 128
    assert row["prompt_tokens"] == 2**31 - 1 and row["completion_tokens"] == -(2**31)
    assert row["queue_time_ms"] is None and row["features"]["x"] is None
    assert row["upstream"]["truncated"] is True and row["upstream"]["bytes"] > 64 * 1024


def test_a_row_the_database_refuses_is_quarantined_and_never_blocks(db_url: str, tmp_path: Path) -> None:
    schema.upgrade(db_url)
    w = writer_for(db_url, tmp_path / "spool", batch_size=50)
    for i in range(30):
        # NOT NULL: no fitting can save a missing outcome
        rec = record(i, outcome=None) if i == 7 else record(i)
        w.submit(rec)
    assert w.flush()
    w.close()
    assert count(db_url) == 29 and w.counters.quarantined == 1 and w.counters.dropped == 0
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        q = conn.execute(select(telemetry_quarantine)).mappings().one()
    engine.dispose()
    assert q["request_id"] == "req-7" and q["error"] and '"req-7"' in q["row"]


def test_a_spool_with_a_bad_row_replays_the_rest(sqlite_url: str, tmp_path: Path) -> None:
    """The spool once replayed the same failing batch forever, across restarts too."""
    schema.upgrade(sqlite_url)
    spool_dir = tmp_path / "spool"
    dead = Spool(spool_dir)
    rows = [{"r": request_row(record(i))} for i in range(10)]
    rows[4]["r"]["arrival_time"] = None  # NOT NULL
    dead.append(rows)
    dead.close()
    w = writer_for(sqlite_url, spool_dir)
    deadline = time.monotonic() + 10
    while count(sqlite_url) < 9 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    assert count(sqlite_url) == 9 and w.counters.quarantined == 1 and w.counters.adopted == 1
    assert count(sqlite_url, telemetry_quarantine) == 1


@pytest.mark.slow
def test_each_process_owns_its_spool_and_takes_over_a_crashed_ones(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    spool_dir = tmp_path / "spool"
    # A live sibling (another process) with rows in its spool: nobody else may touch them.
    alive = subprocess.Popen(
        [sys.executable, "-c", _SIBLING, str(spool_dir), "alive", "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert alive.stdout is not None and alive.stdout.readline().strip() == b"ready"
    # A sibling that crashes after spooling (no close, no cleanup): its lock dies with it.
    subprocess.run([sys.executable, "-c", _SIBLING, str(spool_dir), "crashed", "crash"], check=False)
    assert len(list(spool_dir.glob("spool-*.jsonl"))) == 2
    w = writer_for(sqlite_url, spool_dir)
    deadline = time.monotonic() + 10
    while count(sqlite_url) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert count(sqlite_url) == 5 and w.counters.adopted == 1  # the crashed one's rows, not the live one's
    assert len(list(spool_dir.glob(f"spool-{alive.pid}-*.jsonl"))) == 1  # the live sibling's stays
    assert alive.stdin is not None
    alive.stdin.close()  # the sibling exits normally, leaving its rows for the next writer
    alive.wait(10)
    w._last_scan = 0.0  # scan again now rather than in ten seconds
    deadline = time.monotonic() + 10
    while count(sqlite_url) < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    assert count(sqlite_url) == 10 and w.counters.adopted == 2
    assert list(spool_dir.glob("spool-*.jsonl")) == []


# A process that spools five rows, then waits for stdin to close or exits without cleaning up.
_SIBLING = """
import os, sys, time
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.rows import request_row
from specgate.engine.vocab import SpecParams
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry.records import RequestRecord
spool = Spool(sys.argv[1])
rows = []
for i in range(5):
    now = time.time()
    rec = RequestRecord(f"{sys.argv[2]}-{i}", "chat", "m", now, False, status=200, finished_time=now)
    rows.append({"r": request_row(rec)})
spool.append(rows)
if sys.argv[3] == "crash":
    os._exit(1)
print("ready", flush=True)
sys.stdin.read()
spool.close()
"""


def test_a_failed_spool_write_leaves_no_torn_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from specgate.gateway.telemetry import spool as spool_module

    spool = Spool(tmp_path / "spool")
    spool.append([{"r": {"request_id": "before"}}])
    real = spool_module.write_all

    def half_then_fail(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_module, "write_all", half_then_fail)
    with pytest.raises(OSError):
        spool.append([{"r": {"request_id": "lost-" + "x" * 100}}])
    monkeypatch.setattr(spool_module, "write_all", real)
    spool.append([{"r": {"request_id": "after"}}])
    assert [e["r"]["request_id"] for e in spool.read()] == ["before", "after"]


def test_a_spool_from_before_the_per_process_files_is_adopted(sqlite_url: str, tmp_path: Path) -> None:
    """The single spool file of earlier versions, with the old speculation and timing column names."""
    import json

    schema.upgrade(sqlite_url)
    legacy = tmp_path / "telemetry-spool-old.jsonl"
    row = request_row(record(1))
    row["num_spec_steps"] = row.pop("num_drafts")
    row["received_at"], row["queue_ms"] = row.pop("arrival_time"), row.pop("queue_time_ms")
    legacy.write_text(json.dumps({"r": row}) + "\n")
    w = TelemetryWriter(
        schema.make_engine(sqlite_url),
        Spool(tmp_path / "spool", legacy),
        flush_interval=0.02,
        retry_interval=0.1,
    )
    w.start()
    deadline = time.monotonic() + 10
    while legacy.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    engine = schema.make_engine(sqlite_url)
    with engine.connect() as conn:
        got = conn.execute(select(requests.c.num_drafts, requests.c.arrival_time)).one()
    engine.dispose()
    assert not legacy.exists() and got.num_drafts == 5 and got.arrival_time is not None
