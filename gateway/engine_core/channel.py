"""Pickled messages over a Unix socket between a gateway worker and the shared engine core.

Each message is one frame: an 8-byte length, then the pickle. Neither end ever blocks: the core
reads and writes between steps (`sockets.py`); the client's end (`AsyncChannel`) reads on the event
loop whatever has arrived when the socket is readable (`add_reader`), and a send the socket cannot
take at once is buffered and finished when it is writable (`add_writer`).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import struct
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("specgate.engine_core")
HEADER = struct.Struct("!Q")
READ_SIZE = 1 << 20
# The largest frame either end takes: a submission holds at most a context of token ids and a step's
# outputs at most a batch of tokens and their logprobs, far below this; a longer header is junk or
# an attack, and ends the connection before anything is allocated for it.
MAX_FRAME = 256 << 20


class FrameTooLarge(ValueError):
    pass


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class Frames:
    """Reassembles messages from the bytes as they arrive, in whatever pieces."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out, pos = [], 0
        while len(buf) - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME:
                raise FrameTooLarge(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
            end = pos + HEADER.size + n
            if len(buf) < end:
                break
            out.append(pickle.loads(buf[pos + HEADER.size : end]))
            pos = end
        del buf[:pos]
        return out


class AsyncChannel:
    """The client's end: never blocks the event loop. `on_message` gets each message, `on_eof`
    is called once when the engine core's end is closed (it exited, or was killed)."""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_eof: Callable[[], None],
    ) -> None:
        sock.setblocking(False)
        self._sock, self._loop = sock, loop
        self._on_message, self._on_eof = on_message, on_eof
        self._frames = Frames()
        self._out = bytearray()
        self.closed = False

    def open(self) -> None:
        self._loop.add_reader(self._sock.fileno(), self._readable)

    def send(self, message: Any) -> None:
        if self.closed:
            return  # the engine core is gone; its waiters have been told
        data = frame(message)
        if self._out:
            self._out += data  # keep the order: behind what is already waiting
            return
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # the peer is gone: the reader sees EOF and reports it
        if sent < len(data):
            self._out += data[sent:]
            self._loop.add_writer(self._sock.fileno(), self._writable)

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:
            sent = len(self._out)  # the peer is gone: drop it
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._sock.fileno())

    def _readable(self) -> None:
        try:
            data = self._sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            messages = self._frames.feed(data) if data else None
        except FrameTooLarge as exc:
            logger.error("the engine core sent %s; closing the connection", exc)
            messages = None
        if messages is None:
            self.close()
            self._on_eof()
            return
        for message in messages:
            self._on_message(message)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        fd = self._sock.fileno()
        self._loop.remove_reader(fd)
        self._loop.remove_writer(fd)
        self._sock.close()
