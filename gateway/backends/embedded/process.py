"""The gateway's handle on an engine-core process (`core.py`): starts it, talks to it, stops it.

The child is started with the "spawn" start method: forking a process in which torch (or uvicorn)
has started threads can leave the child with locks held by threads that no longer exist. Messages
go both ways over one socket pair (`channel.py`), read on the event loop without ever blocking it.

The child's end closing (it exited, was killed, crashed, ran out of memory) is seen at once: every
waiting request gets the retryable `EngineUnavailable` (503 with Retry-After) and `alive` turns
false, so the backend's watchdog starts a new core. `close()` asks the child to stop and kills it
if it has not within `stop_timeout`; the child also exits by itself when the gateway's end closes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket

from specgate.engine.config import EngineConfig
from specgate.gateway.backends.embedded.channel import AsyncChannel
from specgate.gateway.backends.embedded.core import LogSettings, run_core
from specgate.gateway.backends.embedded.handle import EngineHandle
from specgate.gateway.backends.embedded.messages import Command, EngineUnavailable
from specgate.gateway.backends.embedded.model_info import ModelInfo

logger = logging.getLogger("specgate.engine_core")


class EngineProcess(EngineHandle):
    def __init__(
        self, config: EngineConfig, loop: asyncio.AbstractEventLoop, *, stop_timeout: float = 10.0
    ) -> None:
        super().__init__()
        self._loop = loop
        self._stop_timeout = stop_timeout
        ours, theirs = socket.socketpair()
        self._theirs: socket.socket | None = theirs
        self._channel = AsyncChannel(ours, loop, self._on_message, self._on_eof)
        self._ready: asyncio.Future[ModelInfo] = loop.create_future()
        # Daemonic: should the gateway exit without close(), multiprocessing still ends the child.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_core,
            args=(theirs, config, LogSettings.current()),
            name="specgate-engine-core",
            daemon=True,
        )
        self._closing = False
        self._reaper: asyncio.Future[None] | None = None

    async def start(self) -> ModelInfo:
        """Start the child and wait until its engine is loaded; raises if it cannot load."""
        await asyncio.to_thread(self.process.start)  # spawning writes the child's arguments to a pipe
        assert self._theirs is not None
        self._theirs.close()  # only the child holds that end now, so its exit reads as EOF here
        self._theirs = None
        self._channel.open()
        logger.info("engine core started (pid %s)", self.process.pid)
        return await self._ready

    @property
    def alive(self) -> bool:
        return self._ready.done() and not self._channel.closed and not self._closing

    def _send(self, command: Command) -> None:
        self._channel.send(command)

    def _on_eof(self) -> None:
        if not self._closing:
            logger.error("the engine core (pid %s) ended unexpectedly", self.process.pid)
        self.fail_waiters(EngineUnavailable("the embedded engine process ended; it is being restarted"))
        if not self._ready.done():
            self._ready.set_exception(RuntimeError("the engine core ended before its engine was loaded"))
        self._reap()  # no zombie

    def _reap(self) -> asyncio.Future[None]:
        """Wait for the child's exit in a thread, one waiter at a time: two threads waiting on one
        child race for its exit status, and the loser takes a dead child for a live one."""
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(asyncio.to_thread(self.process.join, self._stop_timeout))
        return self._reaper

    async def close(self) -> None:
        """Stop the child: ask, wait up to `stop_timeout`, then kill. Safe to call more than once."""
        self._closing = True
        if self.process.pid is None:  # never started
            self._channel.close()
            if self._theirs is not None:
                self._theirs.close()
            return
        self._send(("stop", None))
        await self._reap()
        if self.process.exitcode is None:
            logger.warning("the engine core did not stop within %.0f s; killing it", self._stop_timeout)
            self.process.kill()
            await self._reap()
        self._channel.close()
        if not self._ready.done():
            self._ready.cancel()
