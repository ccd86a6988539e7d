"""One telemetry writer for all the worker processes of a gateway (`specgate serve --workers N`).

The supervisor hosts the only TelemetryStore writer and a `RecordRelayServer` in front of it: a
thread accepting the workers' connections on a Unix socket in the supervisor's private directory.
Each worker's `RelaySink` (relay_sink.py) sends its finished records there in batches.

On the wire a frame is a 4-byte big-endian length and that many bytes: lines of JSON, each one
record's entry (rows.py: its request row and its sampled step rows), plain data, so that nothing a
worker sends is ever run, and an entry the server will not load costs that entry alone, not its
batch. The server answers every frame with one ACK byte once its entries are in the writer's queue;
the sink keeps a batch until it is acknowledged and sends it again on a new connection otherwise.
A batch sent twice is harmless: the writer's inserts ignore a request id that is already there
(ON CONFLICT DO NOTHING).

The socket is only as private as its directory (and it is made 0600). A frame that is too long
closes that connection alone; an entry that will not load is counted and logged, and the rest of
its frame lands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from specgate.gateway.telemetry.idle_cpu import yield_cpu
from specgate.gateway.telemetry.rows import Entry, decode_entry

logger = logging.getLogger("specgate.telemetry")
HEADER = struct.Struct("!I")
ACK = b"\x06"
MAX_FRAME = 64 * 2**20  # a sink's batches are far smaller; a longer frame is not one of ours
ACCEPT_POLL = 0.2  # seconds between looks at the stop flag while nobody connects


def encode_frame(items: list[bytes]) -> bytes:
    """Encoded entries (one line each: JSON never holds a raw newline) as one frame."""
    payload = b"\n".join(items)
    return HEADER.pack(len(payload)) + payload


def read_exactly(conn: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None if the peer closed the connection first."""
    chunks, left = [], n
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class BadFrame(Exception):
    pass


class EntryStore(Protocol):
    def submit_entry(self, entry: Entry) -> None: ...


@dataclass(slots=True)
class RelayCounters:
    connections: int = 0
    frames: int = 0
    records: int = 0
    refused_records: int = 0  # records that would not load (logged)
    bad_frames: int = 0  # connections closed for a frame that is not ours


class RecordRelayServer:
    """The supervisor's end: `RecordRelayServer(store, path).start()`, and `close()` after the
    workers are gone (it waits for every connection to be drained) and before `store.close()`."""

    def __init__(
        self, store: EntryStore, socket_path: str, drain_timeout: float = 30.0, idle: bool = False
    ) -> None:
        self.store = store
        self.idle = idle  # receive at idle CPU priority (idle_cpu.py): no request waits on it
        self.path = socket_path
        self.drain_timeout = drain_timeout
        self.counters = RelayCounters()
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # the store's submit was written for one caller
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._conns_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread = threading.Thread(target=self._accept_loop, name="specgate-relay", daemon=True)

    def start(self) -> RecordRelayServer:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by a supervisor that died
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL)
        self._listener = listener
        self._thread.start()
        return self

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                logger.exception("telemetry relay: accept failed")
                continue
            conn.settimeout(None)
            self.counters.connections += 1
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="specgate-relay-conn", daemon=True
            )
            with self._conns_lock:
                self._conns[thread] = conn
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        if self.idle:
            yield_cpu(what="telemetry relay")
        try:
            self._read_frames(conn, conn.sendall)
        except BadFrame as exc:
            self.counters.bad_frames += 1
            logger.warning("telemetry relay: closing a connection: %s", exc)
        except OSError:
            pass  # the worker went away; whatever it had not seen acknowledged it sends again
        finally:
            conn.close()
            with self._conns_lock:
                self._conns.pop(threading.current_thread(), None)

    def _read_frames(self, conn: socket.socket, reply: Callable[[bytes], None]) -> None:
        while True:
            header = read_exactly(conn, HEADER.size)
            if header is None:
                return  # closed between frames: a clean end
            (size,) = HEADER.unpack(header)
            if size > MAX_FRAME:
                raise BadFrame(f"a {size}-byte frame (the limit is {MAX_FRAME})")
            payload = read_exactly(conn, size)
            if payload is None:
                return  # cut mid-frame: nothing of it was acknowledged, so it will come again
            self._land(payload.split(b"\n") if payload else [])
            reply(ACK)

    def _land(self, items: list[bytes]) -> None:
        self.counters.frames += 1
        entries = []
        for data in items:
            try:
                entries.append(decode_entry(data))
            except ValueError as exc:  # orjson's decode errors are ValueErrors too
                self.counters.refused_records += 1
                logger.warning("telemetry relay: dropping an entry that does not load: %s", exc)
        with self._submit_lock:
            for entry in entries:
                try:
                    self.store.submit_entry(entry)
                    self.counters.records += 1
                except Exception:
                    logger.exception("telemetry store refused request %s", entry["r"]["request_id"])

    def close(self) -> None:
        """Stop accepting, wait for the connected workers to finish (they flush when they close),
        then cut whatever is still connected after `drain_timeout`."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        if self._thread.is_alive():
            self._thread.join()
        with self._conns_lock:
            threads = list(self._conns)
        deadline = time.monotonic() + self.drain_timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._conns_lock:
            stuck = list(self._conns.items())
        for thread, conn in stuck:
            logger.warning(
                "telemetry relay: a worker is still connected after %ss; cutting it", self.drain_timeout
            )
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            thread.join(1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
