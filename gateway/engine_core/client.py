"""The event loop's client of an engine core, with its two transports.

`EngineCoreClient` holds what both share: each request's queue, and the engine's load and state as
of the last `Batch`. It is touched on the event loop only, so it needs no locks. The transports:

- `InprocClient` (`create_app` alone, `specgate serve --engine-thread`): the core's loop on a thread
  of this process, with this client as its one connection; requests reach it on a thread-safe
  queue, and each step's `Batch` comes back in one `call_soon_threadsafe` callback. The engine
  shares the GIL with the event loop here, but tests can reach into it (`engine`, `core`).
- `SocketClient` (the workers of `specgate serve`): a connection to the shared core's Unix socket
  (`process.py`). The core sends its `ModelInfo` (or `LoadFailed`) when it accepts the connection,
  then one `Batch` per step holding this connection's outputs only. Nothing here starts or stops
  that core: the serve supervisor does. The connection closing (the core exited, was killed, or is
  being restarted) is seen at once: every waiting request gets the retryable `EngineUnavailable`
  (503 with Retry-After) and `alive` turns false, so the backend's watchdog connects again
  (`connect`, which retries with backoff while the socket is unreachable); `close()` closes the
  connection, which aborts this worker's requests in the core.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import LoadSnapshot, SpecParams
from specgate.gateway.engine_core.channel import AsyncChannel
from specgate.gateway.engine_core.core import EngineCore
from specgate.gateway.engine_core.messages import (
    READY,
    AbortRequest,
    AddRequest,
    Batch,
    EngineUnavailable,
    Item,
    LoadFailed,
    Request,
    Shutdown,
)
from specgate.gateway.engine_core.model_info import ModelInfo

if TYPE_CHECKING:
    from specgate.engine.engine import Engine

logger = logging.getLogger("specgate.engine_core")


class EngineLoadFailed(RuntimeError):
    """The shared core could not load its engine: reconnecting will not help."""


class EngineCoreClient:
    def __init__(self) -> None:
        self.load = LoadSnapshot()
        self.state = READY
        self.rebuilds = 0
        self.last_error: str | None = None
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._pending = 0  # submitted, not yet taken by the engine
        # Sequences of each tenant submitted through this client and not yet finished (a request
        # with n > 1 holds n batch slots: it counts n).
        self.in_engine: Counter[str] = Counter()
        self._tenants: dict[str, tuple[str, int]] = {}  # request id -> (tenant, n), while in the engine
        # Request id -> its sequences not yet finished (SamplingParams.n): a request with n > 1 is
        # over when the last of its sequences is.
        self._unfinished: dict[str, int] = {}

    # ---- what a transport provides --------------------------------------------------------------

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, request: Request) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.alive and self.state == READY

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: waiting in the engine, or submitted and not yet taken."""
        return self.load.num_waiting + self._pending

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams | None,
        cache_scope: str | None = "",
        prefix_salt: str | None = "",
        tenant: str = "",
    ) -> asyncio.Queue[Item]:
        """Outputs, or the exception that refused the request, arrive on the queue. `cache_scope`,
        `prefix_salt` and `tenant` are the engine's (Engine.add_request): None shares nothing."""
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = q
        self._pending += 1
        self._tenants[request_id] = (tenant, params.n)
        self._unfinished[request_id] = params.n
        self.in_engine[tenant] += params.n
        self._send(AddRequest(request_id, prompt_ids, params, spec, cache_scope, prefix_salt, tenant))
        return q

    def _forget(self, request_id: str) -> None:
        self._unfinished.pop(request_id, None)
        held = self._tenants.pop(request_id, None)
        if held is not None:
            tenant, n = held
            self.in_engine[tenant] -= n
            if self.in_engine[tenant] <= 0:
                del self.in_engine[tenant]

    def abort(self, request_id: str) -> None:
        """The engine frees the request's blocks before its next step."""
        if self._queues.pop(request_id, None) is not None:
            self._forget(request_id)
            self._send(AbortRequest(request_id))

    def orphans(self) -> list[str]:
        """Requests the gateway still waits on."""
        return list(self._queues)

    def fail_waiters(self, error: BaseException) -> None:
        """Every request still waiting on this engine gets `error` (its core is gone)."""
        for request_id in list(self._queues):
            self._queues.pop(request_id).put_nowait(error)
        self._pending = 0
        self._tenants.clear()
        self._unfinished.clear()
        self.in_engine.clear()

    def _apply(self, batch: Batch) -> None:
        self.load, self.state = batch.load, batch.state
        self.rebuilds, self.last_error = batch.rebuilds, batch.last_error
        self._pending = max(0, self._pending - batch.taken)
        for request_id, item in batch.deliveries:
            q = self._queues.get(request_id)
            if q is None:
                continue  # aborted by the gateway; nobody is listening
            q.put_nowait(item)
            if not isinstance(item, BaseException):
                if not item.finished:
                    continue
                left = self._unfinished.get(request_id, 1) - 1
                if left > 0:  # other sequences of this request (n > 1) go on
                    self._unfinished[request_id] = left
                    continue
            del self._queues[request_id]
            self._forget(request_id)


# ---- in-process ----------------------------------------------------------------------------------


class _LocalConnection:
    """The in-process core's one connection: a queue in, the event loop's callback out."""

    def __init__(self, loop: asyncio.AbstractEventLoop, apply: Callable[[Batch], None]) -> None:
        self.queue: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._loop, self._apply = loop, apply

    def get(self, timeout: float | None) -> Request | None:
        try:
            return self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except queue.Empty:
            return None

    def publish(self, batch: Batch) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._apply, batch)


class InprocClient(EngineCoreClient):
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
        self._connection = _LocalConnection(loop, self._apply)
        self.core = EngineCore(
            engine,
            factory,
            self._connection,
            max_step_failures=max_step_failures,
            rebuild_backoff=rebuild_backoff,
        )
        self._thread = threading.Thread(target=self.core.run, name="specgate-engine", daemon=True)

    @property
    def engine(self) -> Engine:
        """The engine itself (in process only): tests inject faults into it."""
        return self.core.engine

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.core.stopping.set()
        self._connection.queue.put(Shutdown())  # wakes an idle loop
        self._thread.join(timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.core.stopping.is_set()

    def _send(self, request: Request) -> None:
        self._connection.queue.put(request)


async def start_in_process(
    build: Callable[[], Engine], loop: asyncio.AbstractEventLoop
) -> tuple[InprocClient, ModelInfo]:
    """A core on a thread of this process, its engine built (off the loop) by `build`, which also
    rebuilds it should it break; and its model."""
    engine = await asyncio.to_thread(build)
    info = await asyncio.to_thread(ModelInfo.of, engine)
    client = InprocClient(engine, loop, build)
    client.start()
    return client, info


# ---- over a socket -------------------------------------------------------------------------------


class SocketClient(EngineCoreClient):
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

    def _send(self, request: Request) -> None:
        if self._channel is not None:
            self._channel.send(request)

    def _on_message(self, message: Any) -> None:
        """A message from the core: a step's outputs, or its answer to loading the model."""
        match message:
            case Batch():
                self._apply(message)
            case ModelInfo() if not self._ready.done():
                self._ready.set_result(message)
            case LoadFailed(error=error) if not self._ready.done():
                self._ready.set_exception(EngineLoadFailed(error))

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
) -> tuple[SocketClient, ModelInfo]:
    """A connected client and the core's model. A core that is unreachable, or that goes away before
    it sends its model, is the supervisor's to restart: this retries (with backoff) until one
    answers; only a core that cannot load its engine (`EngineLoadFailed`) ends the wait."""
    while True:
        client = SocketClient(path, loop)
        try:
            return client, await client.start()
        except OSError as exc:  # refused, no socket, or closed before the model came
            logger.warning("the shared engine core is unreachable (%s); retrying in %.1f s", exc, backoff)
        finally:
            if not client.alive:
                await client.close()
        await asyncio.sleep(backoff)
        backoff = min(max_backoff, backoff * 2)
