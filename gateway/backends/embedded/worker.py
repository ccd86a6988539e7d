"""The engine in a thread of the gateway process (`engine_process = false`): the supervised step
loop runs on its own thread, and the event loop never touches torch.

Commands reach the thread on a thread-safe queue; each step's `Batch` goes back to the event loop in
one `call_soon_threadsafe` callback. The engine shares the GIL with the event loop here, which costs
served latency (the engine-core process avoids it), but tests can reach into the engine directly.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from specgate.engine.engine import Engine
from specgate.gateway.backends.embedded.handle import EngineHandle
from specgate.gateway.backends.embedded.messages import Batch, Command
from specgate.gateway.backends.embedded.supervisor import EngineSupervisor


class _QueueInbox:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def get(self, timeout: float | None) -> Command | None:
        try:
            return self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except queue.Empty:
            return None


class EngineWorker(EngineHandle):
    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[], Engine] | None = None,
        *,
        max_step_failures: int = 3,
        rebuild_backoff: float = 1.0,
    ) -> None:
        super().__init__()
        self._loop = loop
        self._inbox = _QueueInbox()
        self.supervisor = EngineSupervisor(
            engine,
            factory,
            self._inbox,
            self._publish,
            max_step_failures=max_step_failures,
            rebuild_backoff=rebuild_backoff,
        )
        self._thread = threading.Thread(target=self.supervisor.run, name="specgate-engine", daemon=True)

    @property
    def engine(self) -> Engine:
        """The engine itself (thread mode only): tests inject faults into it."""
        return self.supervisor.engine

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.supervisor.stopping.set()
        self._inbox.queue.put(("wake", None))
        self._thread.join(timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.supervisor.stopping.is_set()

    def _send(self, command: Command) -> None:
        self._inbox.queue.put(command)

    def _publish(self, batch: Batch) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._apply, batch)
