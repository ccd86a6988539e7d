"""A lean HTTP/1.1 client connection: an asyncio protocol around llhttp (httptools), one request at
a time, kept alive between requests.

The gateway's upstream calls are small JSON requests to a handful of origins over keep-alive
connections: what they cost is per-request Python, not bytes. This connection does the minimum:
write the request head and body in one call, parse the response with the C parser uvicorn already
uses, and hand body bytes over as they arrive (reading pauses while more than `HIGH_WATER` bytes
wait unread, so a fast upstream cannot fill memory). Pooling and decoding are in
`client.py`; everything here fails as `TransportError`.
"""

from __future__ import annotations

import asyncio
from collections import deque

import httptools

from specgate.gateway.backends.upstream.errors import TransportError

HIGH_WATER = 1 << 20  # unread body bytes at which reading pauses
LOW_WATER = 1 << 18  # ... and resumes


class Http1Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.timed_out = False  # the upstream took too long (as opposed to closing the connection)
        self._parser = httptools.HttpResponseParser(self)
        self._error: TransportError | None = None
        self._head: asyncio.Future[tuple[int, dict[str, str]]] | None = None
        self._names: list[bytes] = []
        self._values: list[bytes] = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._until_close = False  # no length and not chunked: the body ends when the connection does
        self._received = False  # any byte of the current response
        self._waiter: asyncio.Future[bool] | None = None  # True: woken; False: timed out
        self._paused = False
        self._keep_alive = False

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCP transport

    def data_received(self, data: bytes) -> None:
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"invalid HTTP response ({exc})"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._until_close and self._head is not None and self._head.done():
            self._complete = True  # a body delimited by the connection's end is whole now
            self._wake()
        elif not self._complete:
            self._fail(TransportError("the upstream closed the connection" + (f" ({exc})" if exc else "")))

    # ---- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._names.append(name)
        self._values.append(value)

    def on_headers_complete(self) -> None:
        headers: dict[str, str] = {}
        for raw, value in zip(self._names, self._values, strict=True):
            name = raw.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[name] = f"{headers[name]}, {text}" if name in headers else text
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # read here: llhttp forgets it once done
        self._until_close = (
            "content-length" not in headers and not chunked and status >= 200 and status not in (204, 304)
        )
        if self._head is not None and not self._head.done():
            self._head.set_result((status, headers))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # ---- requests -----------------------------------------------------------------------------

    @property
    def received(self) -> bool:
        return self._received

    @property
    def reusable(self) -> bool:
        """Whether the last response ended cleanly and the connection may carry another request."""
        return self._complete and not self.closed and self._keep_alive and not self._chunks

    def send(self, data: bytes) -> None:
        """Start a request: `data` is its head and body."""
        self._received = self.timed_out = False
        if self.closed or self.transport is None or self.transport.is_closing():
            raise TransportError("the connection is closed")
        loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._names, self._values = [], []
        self._head = loop.create_future()
        self._complete = self._until_close = self._keep_alive = False
        self.transport.write(data)

    async def head(self, timeout: float) -> tuple[int, dict[str, str]]:
        """The status and (lower-cased) headers of the response, within `timeout` seconds."""
        assert self._head is not None
        if self._error is not None:
            raise self._error
        try:
            async with asyncio.timeout(timeout):
                return await self._head
        except TimeoutError:
            self.timed_out = True
            self.close()
            raise TransportError(f"no response within {timeout} s") from None

    async def read(self, timeout: float) -> bytes | None:
        """The next body bytes as they arrived; None at the end of the body."""
        while not self._chunks:
            if self._complete:
                return None
            if self._error is not None:
                raise self._error
            loop = asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            # A plain timer, not asyncio.timeout: this runs once per body chunk of every stream.
            timer = loop.call_later(timeout, _expire, waiter)
            try:
                if not await waiter:
                    self.timed_out = True
                    self.close()
                    raise TransportError(f"no data within {timeout} s")
            finally:
                timer.cancel()
                self._waiter = None
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < LOW_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved: a failure no one waits for is not logged as unhandled
        self._wake()
        self.close()


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
