"""A gateway worker's handle on the shared engine core (`specgate serve --workers N`): a connection
to the core's Unix socket, where the single-gateway `EngineProcess` owns a child of its own.

The core sends its `ModelInfo` (or `LoadFailed`) when it accepts the connection, then one `Batch`
per step holding this connection's outputs only. Nothing here starts or stops the core: that is the
supervisor's job. The connection closing (the core exited, was killed, or is being restarted) is
seen at once: every waiting request gets the retryable `EngineUnavailable` (503 with Retry-After)
and `alive` turns false, so the backend's watchdog connects again (`connect`, which retries with
backoff while the socket is unreachable); `close()` closes the connection, which aborts this
worker's requests in the core.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from specgate.gateway.backends.embedded.channel import AsyncChannel
from specgate.gateway.backends.embedded.handle import EngineHandle
from specgate.gateway.backends.embedded.messages import Command, EngineUnavailable
from specgate.gateway.backends.embedded.model_info import ModelInfo

logger = logging.getLogger("specgate.engine_core")


class EngineLoadFailed(RuntimeError):
    """The shared core could not load its engine: reconnecting will not help."""


class EngineClient(EngineHandle):
    load_error = EngineLoadFailed

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.path = path
        self._loop = loop
        self._channel: AsyncChannel | None = None
        self._ready: asyncio.Future[ModelInfo] = loop.create_future()
        self._closing = False

    async def start(self) -> ModelInfo:
        """Connect and wait for the core's model (while a core starts, the connection waits in the
        socket's backlog); raises if the socket is unreachable or the core cannot load."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await self._loop.sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        self._channel = AsyncChannel(sock, self._loop, self._on_message, self._on_eof)
        self._channel.open()
        info = await self._ready
        logger.info("connected to the shared engine core at %s", self.path)
        return info

    @property
    def alive(self) -> bool:
        ready = self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None
        return ready and self._channel is not None and not self._channel.closed and not self._closing

    def _send(self, command: Command) -> None:
        if self._channel is not None:
            self._channel.send(command)

    def _on_eof(self) -> None:
        if not self._closing:
            logger.error("the shared engine core closed the connection")
        self.fail_waiters(EngineUnavailable("the embedded engine process ended; it is being restarted"))
        if not self._ready.done():
            self._ready.set_exception(
                ConnectionError("the engine core closed the connection before its model")
            )

    async def close(self) -> None:
        """Disconnect (the core aborts this connection's requests). Safe to call more than once."""
        self._closing = True
        if self._channel is not None:
            self._channel.close()
        self.fail_waiters(EngineUnavailable("the gateway worker is shutting down"))
        if not self._ready.done():
            self._ready.cancel()


async def connect(
    path: str, loop: asyncio.AbstractEventLoop, *, backoff: float = 0.2, max_backoff: float = 5.0
) -> tuple[EngineClient, ModelInfo]:
    """A connected client and the core's model. A core that is unreachable, or that goes away before
    it sends its model, is the supervisor's to restart: this retries (with backoff) until one
    answers; only a core that cannot load its engine (`EngineLoadFailed`) ends the wait."""
    while True:
        client = EngineClient(path, loop)
        try:
            return client, await client.start()
        except OSError as exc:  # refused, no socket, or closed before the model came
            logger.warning("the shared engine core is unreachable (%s); retrying in %.1f s", exc, backoff)
        finally:
            if not client.alive:
                await client.close()
        await asyncio.sleep(backoff)
        backoff = min(max_backoff, backoff * 2)
