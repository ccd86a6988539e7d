"""The shared engine core's connections (`specgate serve`): one Unix socket, one connection per
gateway worker, all served by one `EngineCore` loop.

`SocketConnections` is the core's `Connections`: it never blocks a step. Between steps it reads
whatever the connections have sent (`get(None)`), and it waits only when the engine is idle
(`get(timeout)`), on every socket at once. Each connection's request ids are prefixed with the
connection's serial inside the engine, so ids are unique by construction however the workers make
theirs, and each step's `Batch` is split so that a connection gets only its own requests' outputs
(and every connection the engine's load). A connection that closes (its worker exited or was
killed) aborts its requests; the core goes on. The serve supervisor's control pipe says when to
stop; its end closing (the supervisor is gone) says so too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import selectors
import socket
import struct
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from specgate.engine.outputs import RequestOutput
from specgate.gateway.engine_core.channel import READ_SIZE, Frames, FrameTooLarge, frame
from specgate.gateway.engine_core.messages import (
    AbortRequest,
    AddRequest,
    Batch,
    Item,
    LoadFailed,
    Request,
    Shutdown,
)
from specgate.gateway.engine_core.model_info import ModelInfo

logger = logging.getLogger("specgate.engine_core")
MAX_BACKLOG = 256 * 2**20  # bytes a worker may leave unread before it is judged stuck and dropped
_LISTENER, _CONTROL = "listener", "control"


@dataclass(slots=True, eq=False)
class _Conn:
    serial: int
    sock: socket.socket
    frames: Frames = field(default_factory=Frames)
    out: bytearray = field(default_factory=bytearray)  # what the socket could not take yet
    owned: set[str] = field(default_factory=set)  # engine ids of its requests still in the engine
    # Engine id -> its sequences not yet finished, for requests with n > 1 (SamplingParams.n).
    unfinished: dict[str, int] = field(default_factory=dict)
    taken: int = 0  # its submissions handed to the engine since its last batch

    def engine_id(self, request_id: str) -> str:
        return f"{self.serial}:{request_id}"


def same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this one's user (SO_PEERCRED;
    where the platform has none, the socket file's 0600 mode is the only guard)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return True
    creds = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return bool(uid == os.getuid())


class SocketConnections:
    def __init__(self, listener: socket.socket, control: Connection, hello: ModelInfo | LoadFailed) -> None:
        self._hello = hello  # sent to each connection as it is accepted
        self._listener = listener
        self._control: Connection | None = control
        listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(control, selectors.EVENT_READ, _CONTROL)
        self._conns: dict[int, _Conn] = {}
        self._serials = itertools.count(1)
        self._inbox: deque[tuple[_Conn | None, Request]] = deque()

    @property
    def connections(self) -> int:
        return len(self._conns)

    # ---- what the core reads --------------------------------------------------------------------

    def get(self, timeout: float | None) -> Request | None:
        """The next request from any connection (or the control pipe), waiting up to `timeout`."""
        if not self._inbox:
            self._poll(timeout or 0.0)
        while self._inbox:
            conn, request = self._inbox.popleft()
            if conn is None:
                return request
            if conn.serial not in self._conns:
                continue  # its worker is gone; its aborts are already queued
            if isinstance(request, AddRequest):
                conn.taken += 1
            return request
        return None

    def _poll(self, timeout: float) -> None:
        for key, events in self._sel.select(timeout):
            if key.data is _LISTENER:
                self._accept()
            elif key.data is _CONTROL:
                self._on_control()
            else:
                conn: _Conn = key.data
                if events & selectors.EVENT_WRITE:
                    self._flush(conn)
                if events & selectors.EVENT_READ and conn.serial in self._conns:
                    self._read(conn)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if not same_user(sock):
            logger.error("refused an engine-core connection from another user")
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(next(self._serials), sock)
        self._conns[conn.serial] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        logger.info("a gateway worker connected (%d connected)", len(self._conns))
        self._send(conn, self._hello)

    def _on_control(self) -> None:
        # Any message is "stop"; so is the supervisor's end closing (it is gone, however it went).
        assert self._control is not None
        try:
            self._control.recv()
        except (EOFError, OSError):
            logger.warning("the supervisor is gone; the engine core stops")
        self._sel.unregister(self._control)
        self._control.close()
        self._control = None
        self._inbox.append((None, Shutdown()))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, "closed its connection")
            return
        try:
            messages = conn.frames.feed(data)
        except FrameTooLarge as exc:
            self._drop(conn, f"sent {exc}")
            return
        for message in messages:
            match message:
                case AddRequest(request_id=request_id):
                    add = dataclasses.replace(message, request_id=conn.engine_id(request_id))
                    conn.owned.add(add.request_id)
                    if add.params.n > 1:
                        conn.unfinished[add.request_id] = add.params.n
                    self._inbox.append((conn, add))
                case AbortRequest(request_id=request_id):
                    engine_id = conn.engine_id(request_id)
                    if engine_id in conn.owned:
                        conn.owned.discard(engine_id)
                        conn.unfinished.pop(engine_id, None)
                        self._inbox.append((conn, AbortRequest(engine_id)))
                case Shutdown():
                    pass  # the core is shared: only the supervisor stops it
                case _:
                    self._drop(conn, f"sent a malformed request ({type(message).__name__})")
                    return

    def _drop(self, conn: _Conn, why: str) -> None:
        """A worker is gone: its requests are aborted (their KV blocks freed), the core goes on."""
        if self._conns.pop(conn.serial, None) is None:
            return
        self._sel.unregister(conn.sock)
        conn.sock.close()
        for request_id in conn.owned:
            self._inbox.append((None, AbortRequest(request_id)))
        logger.warning(
            "a gateway worker %s; %d of its requests aborted (%d connected)",
            why,
            len(conn.owned),
            len(self._conns),
        )
        conn.owned.clear()
        conn.unfinished.clear()

    # ---- what the core publishes ----------------------------------------------------------------

    def publish(self, batch: Batch) -> None:
        """Each connection gets its own requests' outputs, its own count of taken submissions, and
        the engine's load and state (the same for all: there is one engine)."""
        mine: dict[int, list[tuple[str, Item]]] = {}
        for engine_id, item in batch.deliveries:
            serial, _, request_id = engine_id.partition(":")
            conn = self._conns.get(int(serial)) if serial.isdigit() else None
            if conn is None or engine_id not in conn.owned:
                continue  # aborted, or its worker is gone: nobody is listening
            if isinstance(item, RequestOutput):
                item.request_id = request_id
            mine.setdefault(conn.serial, []).append((request_id, item))
            if isinstance(item, RequestOutput) and item.finished and engine_id in conn.unfinished:
                conn.unfinished[engine_id] -= 1
                if conn.unfinished[engine_id] > 0:
                    continue  # other sequences of this request (n > 1) go on
            if isinstance(item, BaseException) or item.finished:
                conn.owned.discard(engine_id)
                conn.unfinished.pop(engine_id, None)
        for conn in list(self._conns.values()):
            news = Batch(
                mine.get(conn.serial, []),
                conn.taken,
                batch.load,
                batch.state,
                batch.rebuilds,
                batch.last_error,
            )
            conn.taken = 0
            self._send(conn, news)

    def _send(self, conn: _Conn, message: Any) -> None:
        """Never blocks the step: what the socket cannot take now waits for the next poll."""
        data = frame(message)
        if not conn.out:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn, "is unreachable")
                return
            if sent == len(data):
                return
            data = data[sent:]
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.out += data
        if len(conn.out) > MAX_BACKLOG:
            self._drop(conn, f"left over {MAX_BACKLOG >> 20} MiB unread (stuck)")

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn, "is unreachable")
            return
        del conn.out[:sent]
        if not conn.out:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._sel.unregister(conn.sock)
            conn.sock.close()
        self._conns.clear()
        if self._control is not None:
            self._control.close()
        self._sel.close()
        self._listener.close()
