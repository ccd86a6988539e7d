"""One telemetry writer for all the worker processes of a gateway (`specgate serve --workers N`).

The supervisor hosts the only TelemetryStore writer and a `RecordRelayServer` in front of it: a
thread accepting the workers' connections on a Unix socket in the supervisor's private directory.
Each worker's `RelaySink` (relay_sink.py) sends its finished records there in batches.

On the wire a frame is a 4-byte big-endian length and that many bytes: a pickled list of byte
strings, each one pickled RequestRecord (pickled one by one so that a record the server will not
load costs that record alone, not its batch). The server answers every frame with one ACK byte once
its records are in the store's queue; the sink keeps a batch until it is acknowledged and sends it
again on a new connection otherwise. A batch sent twice is harmless: the writer's inserts ignore a
request id that is already there (ON CONFLICT DO NOTHING).

The socket is only as private as its directory (and it is made 0600), and unpickling runs only the
constructors of the few classes a record is made of (`RecordLoader`). A frame that is too long or
is not a list of byte strings closes that connection alone; a record that will not load is counted
and logged, and the rest of its frame lands.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.telemetry.idle_cpu import yield_cpu
from specgate.gateway.telemetry.records import RequestRecord

logger = logging.getLogger("specgate.telemetry")
HEADER = struct.Struct("!I")
ACK = b"\x06"
MAX_FRAME = 64 * 2**20  # a sink's batches are far smaller; a longer frame is not one of ours
ACCEPT_POLL = 0.2  # seconds between looks at the stop flag while nobody connects


def _allowed() -> frozenset[tuple[str, str]]:
    names = {(c.__module__, c.__qualname__) for c in (RequestRecord, RouteDecision, SpecParams)}
    # The classifier's probabilities can reach a record's features as numpy scalars.
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        names.add((module, "scalar"))
    names.add(("numpy", "dtype"))
    return frozenset(names)


ALLOWED = _allowed()


class RecordLoader(pickle.Unpickler):
    """An unpickler that builds nothing but the classes a record is made of."""

    allowed = ALLOWED

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


class FrameLoader(RecordLoader):
    allowed: frozenset[tuple[str, str]] = frozenset()  # a frame is a list of byte strings: no classes


def load_record(data: bytes) -> RequestRecord:
    record = RecordLoader(io.BytesIO(data)).load()
    if not isinstance(record, RequestRecord):
        raise pickle.UnpicklingError(f"a {type(record).__name__}, not a RequestRecord")
    return record


def encode_frame(items: list[bytes]) -> bytes:
    payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
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


def decode_frame(payload: bytes) -> list[bytes]:
    """The frame's items (a pickled list of byte strings: no class is loaded to read it)."""
    try:
        items = FrameLoader(io.BytesIO(payload)).load()
    except Exception as exc:  # garbage fails in many ways
        raise BadFrame(f"not a frame: {exc!r}") from None
    if not isinstance(items, list) or not all(isinstance(i, bytes) for i in items):
        raise BadFrame("a frame is a list of byte strings")
    return items


class RecordStore(Protocol):
    def submit(self, record: RequestRecord) -> None: ...


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
        self, store: RecordStore, socket_path: str, drain_timeout: float = 30.0, idle: bool = False
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
            self._land(decode_frame(payload))
            reply(ACK)

    def _land(self, items: list[bytes]) -> None:
        self.counters.frames += 1
        records = []
        for data in items:
            try:
                records.append(load_record(data))
            except Exception as exc:
                self.counters.refused_records += 1
                logger.warning("telemetry relay: dropping a record that does not load: %r", exc)
        with self._submit_lock:
            for record in records:
                try:
                    self.store.submit(record)
                    self.counters.records += 1
                except Exception:
                    logger.exception("telemetry store refused request %s", record.request_id)

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
