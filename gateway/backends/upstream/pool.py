"""The upstream pool's parts: a bound on connections in use, and kept-alive connections by origin."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from specgate.gateway.backends.upstream.errors import PoolTimeout
from specgate.gateway.backends.upstream.http1 import Http1Connection

# An idle upstream connection is not reused after this long: under the 5 s keep-alive of uvicorn
# (vLLM, SGLang, llama.cpp's Python server), so we rarely send on a connection being closed.
KEEPALIVE_SECONDS = 4.0


class Slots:
    """At most `n` requests hold a connection; the rest wait, first come first served."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def take(self, timeout: float) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.give()  # handed a slot just as it gave up: pass it on
            if isinstance(exc, TimeoutError):
                raise PoolTimeout(f"no free connection within {timeout} s") from None
            raise

    def give(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot goes straight to the next in line
                return
        self.free += 1


class IdleConnections:
    """Kept-alive connections by origin, the most recently used first."""

    def __init__(self) -> None:
        self.conns: dict[str, list[Http1Connection]] = {}

    def take(self, origin: str) -> Http1Connection | None:
        stack = self.conns.get(origin)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_SECONDS:
                return conn
            conn.close()
        return None

    def put(self, origin: str, conn: Http1Connection) -> None:
        conn.idle_since = time.monotonic()
        self.conns.setdefault(origin, []).append(conn)

    def close(self) -> None:
        for stack in self.conns.values():
            for conn in stack:
                conn.close()
        self.conns.clear()
