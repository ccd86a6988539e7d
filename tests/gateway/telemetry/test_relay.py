"""The telemetry relay: a real server on a Unix socket in front of a real SQLite store, worker sinks
in threads and in a spawned process; a server that dies and comes back; hostile frames."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pydantic import SecretStr
from sqlalchemy import func, select

from specgate.engine.vocab import SpecParams
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.settings import TelemetrySettings
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.relay import ACK, HEADER, RecordRelayServer, encode_frame
from specgate.gateway.telemetry.relay_sink import RelaySink
from specgate.gateway.telemetry.rows import encode_entry, entry_of
from specgate.gateway.telemetry.store import TelemetryStore
from specgate.gateway.telemetry.tables import requests


def record(name: str) -> RequestRecord:
    # numpy scalars do reach records (a classifier's probabilities, in what the policy saw)
    features = {"p_code": np.float64(0.75), "p_chat": np.float32(0.25), "prompt_chars": 42}
    route = RouteDecision("m", ["embedded"], SpecParams("ngram", "goodput", 0, 8), features=features)
    route = route.served_by("embedded", external=False)
    return RequestRecord(
        name,
        "chat",
        "m",
        arrival_time=time.time() - 1,
        stream=False,
        status=200,
        backend="embedded",
        prompt_tokens=10,
        completion_tokens=20,
        route=route,
        finished_time=time.time(),
    )


def settings(tmp: Path) -> TelemetrySettings:
    url = f"sqlite:///{tmp / 'telemetry.db'}"
    return TelemetrySettings(
        url=SecretStr(url), auto_upgrade=True, spool_dir=str(tmp / "spool"), flush_interval=0.02
    )


def rows(store: TelemetryStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(requests)).scalar_one())


@pytest.fixture
def tmp() -> Iterator[Path]:
    # Short: a Unix socket's path must fit in 108 bytes, which pytest's tmp_path may not.
    path = Path(tempfile.mkdtemp(prefix="relay-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(tmp: Path) -> Iterator[TelemetryStore]:
    s = TelemetryStore(settings(tmp))
    s.open()
    yield s
    s.close()


def _worker_process(path: str, n: int) -> None:
    sink = RelaySink(path).start()
    for i in range(n):
        sink.submit(record(f"proc-{i}"))
    sink.close()
    assert sink.counters.dropped == 0


@pytest.mark.slow
def test_records_from_threads_and_a_process_all_land(tmp: Path, store: TelemetryStore) -> None:
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path).start()
    assert os.stat(path).st_mode & 0o777 == 0o600
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_worker_process, args=(path, 300))
    proc.start()
    sinks = [RelaySink(path, batch_size=64).start() for _ in range(2)]

    def submit(sink: RelaySink, tag: str) -> None:
        for i in range(500):
            sink.submit(record(f"{tag}-{i}"))

    threads = [threading.Thread(target=submit, args=(s, f"t{n}")) for n, s in enumerate(sinks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sinks:
        s.close()  # flushes
        assert s.counters.written == 500 and s.counters.dropped == 0
    proc.join(60)
    assert proc.exitcode == 0
    server.close()  # every connection drained before the store closes
    assert store.writer is not None and store.writer.flush(20)
    assert rows(store) == 1300 and server.counters.records == 1300
    with store.engine.connect() as conn:
        features = conn.execute(
            select(requests.c.features).where(requests.c.request_id == "proc-7")
        ).scalar_one()
    assert features["p_code"] == 0.75


@pytest.mark.slow
def test_a_dead_server_then_a_new_one_loses_nothing(tmp: Path, store: TelemetryStore) -> None:
    path = str(tmp / "t.sock")
    sink = RelaySink(path, flush_interval=0.01, max_backoff=0.05).start()
    for i in range(100):
        sink.submit(record(f"early-{i}"))  # nobody listens yet: they wait
    time.sleep(0.3)
    assert sink.counters.db_errors > 0 and sink.queue_size() == 100
    server = RecordRelayServer(store, path, drain_timeout=0.2).start()
    _until(lambda: sink.counters.written == 100)
    server.close()  # the sink is still connected: it is cut
    for i in range(100):
        sink.submit(record(f"late-{i}"))
    time.sleep(0.2)
    server = RecordRelayServer(store, path).start()  # a restarted supervisor, same path
    sink.close()
    server.close()
    assert sink.counters.dropped == 0 and sink.counters.written >= 200
    assert store.writer is not None and store.writer.flush(20)
    assert rows(store) == 200


class _Exploit:
    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, ("touch /tmp/specgate-relay-pwned",))


def _raw(path: str, data: bytes) -> bytes:
    """Send raw bytes; what the server answers before it closes (b"": it closed at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(path)
        conn.sendall(data)
        got = b""
        try:
            while chunk := conn.recv(16):
                got += chunk
                if got.endswith(ACK):
                    break
        except ConnectionResetError:  # closed with our bytes unread
            pass
        return got


def test_hostile_frames_cost_only_themselves(tmp: Path, store: TelemetryStore) -> None:
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path).start()
    sink = RelaySink(path).start()
    sink.submit(record("before"))
    assert _raw(path, HEADER.pack(2**31)) == b""  # a huge length: closed before reading a byte of it
    # Whatever a frame's lines hold, nothing in them is run: a pickle that would run a command,
    # garbage, JSON that is not an entry; each is refused alone and the good entry lands.
    good = encode_entry(entry_of(record("good")))
    hostile = [
        pickle.dumps(_Exploit()).replace(b"\n", b" "),
        b"\x80\x04garbage",
        b'{"not": "an entry"}',
        b'{"r": {"request_id": 7}}',
        b'{"r": {"request_id": "x"}, "s": "steps"}',
    ]
    assert _raw(path, encode_frame([*hostile, good])) == ACK
    assert not os.path.exists("/tmp/specgate-relay-pwned")
    sink.submit(record("after"))
    sink.close()
    server.close()
    assert server.counters.bad_frames == 1 and server.counters.refused_records == len(hostile)
    assert store.writer is not None and store.writer.flush(20)
    assert rows(store) == 3  # before, good, after


def test_a_worker_store_writes_through_the_relay(tmp: Path, store: TelemetryStore) -> None:
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path).start()
    worker = TelemetryStore(settings(tmp), relay=path)
    worker.open()  # checks the schema the supervisor's store made; starts no writer
    assert worker.writer is None and worker.relay is not None
    worker.submit(record("w-1"))
    ok, detail = asyncio.run(worker.ready())
    assert ok and "relay backlog" in detail
    worker.close()
    server.close()
    assert worker.counters.written == 1 and worker.queue_size() == 0
    assert store.writer is not None and store.writer.flush(20)
    assert rows(store) == 1


def _until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_value_json_has_no_form_for_still_lands(tmp: Path, store: TelemetryStore) -> None:
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path).start()
    sink = RelaySink(path).start()
    odd = record("odd")
    assert odd.route is not None
    features = {"when": dt.date(2026, 1, 2), "what": object()}
    odd = dataclasses.replace(odd, route=dataclasses.replace(odd.route, features=features))
    sink.submit(record("first"))
    sink.submit(odd)  # encoded on the spot, the odd values as their text
    sink.submit(record("last"))
    sink.close()
    server.close()
    assert sink.counters.written == 3 and sink.counters.dropped == 0
    assert store.writer is not None and store.writer.flush(20)
    assert rows(store) == 3
    with store.engine.connect() as conn:
        query = select(requests.c.features).where(requests.c.request_id == "odd")
        features = conn.execute(query).scalar_one()
    assert features["when"] == "2026-01-02" and features["what"].startswith("<object")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle", [True, False])
def test_an_idle_relay_receives_at_idle_priority(tmp: Path, store: TelemetryStore, idle: bool) -> None:
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path, idle=idle).start()
    sink = RelaySink(path).start()
    sink.submit(record("r"))
    _until(lambda: sink.counters.written == 1)  # acknowledged: its connection's thread is up
    (thread,) = list(server._conns)
    assert thread.native_id is not None
    policy = os.sched_getscheduler(thread.native_id)
    assert policy == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
    sink.close()
    server.close()


def test_what_orjson_refuses_still_lands(tmp: Path, store: TelemetryStore) -> None:
    """An upstream's answer kept as parsed can hold integers past 64 bits, lone surrogates, NaN or
    nesting deeper than any encoder goes: the row crosses the relay all the same."""
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    odd = {"big": 2**70, "text": "\ud800x", "nan": float("nan")}
    path = str(tmp / "t.sock")
    server = RecordRelayServer(store, path).start()
    sink = RelaySink(path).start()
    sink.submit(dataclasses.replace(record("odd"), upstream={"metrics": odd}))
    sink.submit(dataclasses.replace(record("deep"), upstream={"metrics": deep}))
    sink.close()
    server.close()
    assert sink.counters.written == 2 and sink.counters.dropped == 0
    assert store.writer is not None and store.writer.flush(20)
    with store.engine.connect() as conn:
        got = dict(conn.execute(select(requests.c.request_id, requests.c.upstream)).all())
    # Fitted as the writer fits every JSON column (fit.py): what no database stores becomes null.
    assert got["odd"]["metrics"] == {"big": None, "text": "?x", "nan": None}
    assert got["deep"] == {"unencodable": "nested too deep to encode"}
