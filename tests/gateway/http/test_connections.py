"""What one connection may cost the gateway: deadlines for the request head and the body, and caps
on open connections per process and per client address, against a live gateway over raw sockets
(a slowloris client, a half-open flood, a body that trickles)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from specgate.gateway.http.connections import connection_cap
from specgate.gateway.settings import ConnectionSettings
from tests.gateway.live import LiveGateway, free_port, record_of, start_gateway, tiny_settings, wait_for


def _connect(live: LiveGateway, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", live.port), timeout=10, source_address=(source, 0))
    s.settimeout(10)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not part:
            break
        out += part
    return out


def _closed(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(
            str(tiny_llama_dir),
            log_requests=False,
            connections={
                "head_timeout": 0.6,
                "body_read_timeout": 0.5,
                "body_timeout": 1.5,
                "max_per_address": 8,
            },
        )
    )
    yield live
    live.stop()


def _guard(live: LiveGateway) -> object:
    return live.server.config.http_protocol_class.guard  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_half_sent_head_gets_408_and_the_connection_is_closed(guarded: LiveGateway) -> None:
    s = _connect(guarded)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
    start = time.monotonic()
    answer = _read_all(s)
    took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert 0.4 < took < 3.0


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(guarded: LiveGateway) -> None:
    s = _connect(guarded)
    start = time.monotonic()
    assert _closed(s, within=5.0)
    assert time.monotonic() - start < 3.0


@pytest.mark.slow
def test_the_head_deadline_runs_again_for_each_request_on_a_kept_alive_connection(
    guarded: LiveGateway,
) -> None:
    s = _connect(guarded)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    first = s.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /healthz HTTP/1.1\r\n")  # the second request's head stalls
    assert _read_all(s).startswith(b"HTTP/1.1 408 ")


def test_a_body_that_stops_coming_is_a_408_and_a_record(guarded: LiveGateway) -> None:
    s = _connect(guarded)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: stalled-body\r\ncontent-length: 100000\r\n\r\n"
    )
    s.sendall(head + b'{"model": "x", "messages": [')
    start = time.monotonic()
    answer = _read_all(s)  # read to EOF: the connection is closed after the 408
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert b"connection: close" in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 3.0
    rec = record_of(guarded, "stalled-body")
    assert rec is not None and rec.status == 408 and rec.error_code == "request_timeout"


@pytest.mark.slow
def test_a_trickling_body_is_cut_at_the_whole_body_deadline(guarded: LiveGateway) -> None:
    s = _connect(guarded)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n"
    )
    start = time.monotonic()
    answer = b""
    while time.monotonic() - start < 6 and not answer:
        try:
            s.sendall(b" ")  # a byte every 0.2 s: every read is on time, the whole never is
        except (BrokenPipeError, ConnectionResetError):
            break
        s.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert 1.2 < time.monotonic() - start < 4.0


def test_a_slow_body_never_holds_an_engine_slot(guarded: LiveGateway) -> None:
    s = _connect(guarded)
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 100000\r\n\r\n{"
    )
    time.sleep(0.2)
    worker = guarded.services.registry.embedded.client  # type: ignore[union-attr]
    assert worker is not None and worker.num_waiting == 0 and worker.load.num_running == 0
    _read_all(s)


def test_a_half_open_flood_from_one_address_leaves_the_gateway_answering(guarded: LiveGateway) -> None:
    guard = _guard(guarded)
    evicted = guard.evicted  # type: ignore[attr-defined]
    flood = [_connect(guarded) for _ in range(40)]  # five times the per-address cap, all half-open
    for s in flood[::2]:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
    # The same address's legitimate request still gets in: the oldest idle connection makes room.
    r = httpx.get(f"{guarded.url}/healthz", timeout=5)
    assert r.status_code == 200
    assert guard.evicted - evicted >= 32  # type: ignore[attr-defined]
    assert guard.per_address.get("127.0.0.1", 0) <= 8  # type: ignore[attr-defined]
    for s in flood:
        s.close()


@pytest.mark.slow
def test_connections_busy_with_a_request_are_never_closed_for_a_newcomer(
    tiny_llama_dir: Path,
) -> None:
    live = start_gateway(
        tiny_settings(str(tiny_llama_dir), log_requests=False, connections={"max_per_address": 2})
    )
    try:
        model = live.services.registry.embedded.served_name  # type: ignore[union-attr]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200,
            "ignore_eos": True,
            "stream": True,
        }
        done: list[int] = []

        def stream() -> None:
            with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
                done.append(r.status_code)

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        worker = live.services.registry.embedded.client  # type: ignore[union-attr]
        assert wait_for(lambda: worker is not None and worker.load.num_running == 2, 20)
        with pytest.raises(httpx.TransportError):  # both connections are busy: the newcomer is closed
            httpx.get(f"{live.url}/healthz", timeout=5)
        # Another address has room of its own.
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        assert other.get(f"{live.url}/healthz", timeout=5).status_code == 200
        other.close()
        for t in threads:
            t.join(60)
        assert done == [200, 200]  # the busy ones finished untouched
    finally:
        live.stop()


def test_the_process_cap_stays_below_the_file_limit() -> None:
    settings = ConnectionSettings()
    assert connection_cap(settings, 256) == 128  # 128 descriptors kept for the process itself
    assert connection_cap(settings, 1 << 20) == 65_536
    assert connection_cap(ConnectionSettings(max_connections=100), 1 << 20) == 100
    assert connection_cap(ConnectionSettings(max_connections=10_000), 1024) == 768


@pytest.mark.slow
def test_1500_half_open_connections_leave_a_256_descriptor_gateway_answering(tmp_path: Path) -> None:
    """The attack as the issue saw it: a worker limited to 256 descriptors, flooded from one address."""
    port = free_port()
    config = tmp_path / "gw.json"
    config.write_text(
        json.dumps({"embedded": {"enabled": False}, "telemetry": {"enabled": False}, "port": port})
    )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    env = {**os.environ, "SPECGATE_DATA_DIR": tempfile.mkdtemp(dir=tmp_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specgate.gateway.cli.main",
            "serve",
            "--config",
            str(config),
            "--engine-thread",
        ],
        preexec_fn=limit,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    flood: list[socket.socket] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))  # the flood's own descriptors
    try:
        assert wait_for(lambda: _answers(url), 60), "the gateway did not start"
        for i in range(1500):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                break  # this process's own descriptors ran out first: enough of a flood
            if i % 3 == 0:
                s.sendall(b"GET /healthz HTTP/1.1\r\n")
            flood.append(s)
        assert len(flood) >= 900
        for _ in range(5):
            start = time.monotonic()
            r = httpx.get(f"{url}/healthz", timeout=5)
            assert r.status_code == 200 and time.monotonic() - start < 1.0
    finally:
        for s in flood:
            s.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert b"Traceback" not in err, err.decode(errors="replace")[-2000:]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
