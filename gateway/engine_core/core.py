"""The engine core: one engine and its supervised step loop, serving 1..N connections.

The loop is the same wherever it runs (a thread of the gateway process, with one in-process
connection; the shared core process of `specgate serve`, with one socket connection per worker):
take what the connections sent (`AddRequest`, `AbortRequest`, `Shutdown`), call `Engine.step()`,
hand the connections one `Batch` per step. How requests arrive and how each connection gets its
share of a batch is the `Connections` object's business (`client.py`'s in-process queue, or
`sockets.py`'s fan-out over Unix sockets).

A request the engine refuses, or one that fails inside a step, fails alone (the engine isolates
it). A step that raises fails the requests in flight; when steps keep failing (`max_step_failures`
in a row, counting failed forward passes), the engine is judged broken and rebuilt from its factory
while new requests get 503 with Retry-After, and `state` says "rebuilding" (so /readyz does). A
rebuild that fails is retried with backoff. The loop never dies of an exception; whoever runs it
notices if it ends anyway (a dead thread, a dead process) and replaces it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from specgate.engine.errors import RequestError
from specgate.engine.vocab import LoadSnapshot
from specgate.gateway.engine_core.messages import (
    READY,
    REBUILDING,
    AbortRequest,
    AddRequest,
    Batch,
    EngineUnavailable,
    Item,
    Request,
    Shutdown,
)

if TYPE_CHECKING:
    from specgate.engine.engine import Engine

logger = logging.getLogger("specgate.engine_core")
IDLE_WAIT = 0.5  # seconds an idle loop waits for a request before it looks at `stopping` again


class Connections(Protocol):
    """Where the core's requests come from and its batches go."""

    def get(self, timeout: float | None) -> Request | None:
        """The next request, waiting up to `timeout` seconds (None: not at all); None if none came."""

    def publish(self, batch: Batch) -> None:
        """One step's news: each connection gets its own requests' part of it."""


class EngineCore:
    def __init__(
        self,
        engine: Engine,
        factory: Callable[[], Engine] | None,
        connections: Connections,
        *,
        max_step_failures: int = 3,
        rebuild_backoff: float = 1.0,
    ) -> None:
        self.engine = engine
        self.factory = factory
        self.load = LoadSnapshot()
        self.state = READY
        self.last_error: str | None = None
        self.rebuilds = 0
        self.stopping = threading.Event()
        self._connections = connections
        self._max_step_failures = max_step_failures
        self._rebuild_backoff = rebuild_backoff
        self._step_failures = 0

    def run(self) -> None:
        while not self.stopping.is_set():
            deliveries: list[tuple[str, Item]] = []
            taken, stepped = 0, False
            try:
                taken = self._drain(not self.engine.has_unfinished(), deliveries)
                if self.stopping.is_set():
                    break
                if self.engine.has_unfinished():
                    stepped = True
                    self._step(deliveries)
            except Exception as exc:  # a bug outside the engine's own isolation: fail what is in flight
                logger.exception("engine step failed; failing the requests in flight")
                deliveries.extend(self._fail_all(exc))
                self._step_failures += 1
            if deliveries or taken or stepped:  # before any rebuild: these requests must not wait for it
                self._send(deliveries, taken)
            broken = max(self._step_failures, self.engine.consecutive_forward_failures)
            if broken >= self._max_step_failures:
                self._rebuild()
        if self.engine is not None:  # None when stopped in the middle of a rebuild
            for request_id in self.engine.request_ids():
                self.engine.abort(request_id)

    def _send(self, deliveries: list[tuple[str, Item]], taken: int) -> None:
        batch = Batch(deliveries, taken, self.load, self.state, self.rebuilds, self.last_error)
        self._connections.publish(batch)

    def _step(self, deliveries: list[tuple[str, Item]]) -> None:
        outputs = self.engine.step()
        self._step_failures = 0
        for out in outputs:
            deliveries.append((out.request_id, out))
        self._refresh_load()

    def _refresh_load(self) -> None:
        try:
            self.load = self.engine.load()
        except Exception:
            self.load = LoadSnapshot()

    def _drain(self, block: bool, deliveries: list[tuple[str, Item]]) -> int:
        taken = 0
        request = self._connections.get(IDLE_WAIT if block else None)
        while request is not None:
            match request:
                case AddRequest():
                    taken += 1
                    self._admit(request, deliveries)
                case AbortRequest(request_id=request_id):
                    self.engine.abort(request_id)
                case Shutdown():
                    self.stopping.set()
                    break
            request = self._connections.get(None)
        return taken

    def _admit(self, add: AddRequest, deliveries: list[tuple[str, Item]]) -> None:
        rid = add.request_id
        try:
            add.add_to(self.engine)
        except RequestError as exc:
            deliveries.append((rid, exc))
        except Exception as exc:  # a bug while admitting one request: that request fails
            logger.exception("the engine failed to admit request %s", rid)
            deliveries.append((rid, RuntimeError(f"the engine failed to admit it ({type(exc).__name__})")))

    def _fail_all(self, exc: BaseException) -> list[tuple[str, Item]]:
        failed = self.engine.request_ids()
        try:
            for request_id in failed:
                self.engine.abort(request_id)
            self.engine.step()  # collects the aborts so their blocks are freed
        except Exception:
            logger.exception("engine cleanup after a failed step also failed")
            self._step_failures = self._max_step_failures  # its state is suspect: rebuild it
        error = RuntimeError(f"engine step failed: {type(exc).__name__}")
        self._refresh_load()
        return [(rid, error) for rid in failed]

    def _rebuild(self) -> None:
        """Replace a broken engine; the requests it held fail with a retryable error."""
        import torch  # the engine's owner has it loaded already

        unavailable = EngineUnavailable("the embedded engine failed and is being rebuilt")
        try:
            held = self.engine.request_ids()
        except Exception:
            held = []
        if self.factory is None:
            logger.error("the embedded engine is broken and has no factory to rebuild it from")
            self._step_failures = self.engine.consecutive_forward_failures = 0
            return
        self.state = REBUILDING
        self.load = LoadSnapshot()
        self._send([(rid, unavailable) for rid in held], 0)
        # Let the broken engine (weights, KV pool) go before the new one is built beside it.
        self.engine = cast("Engine", None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        wait = self._rebuild_backoff
        while not self.stopping.is_set():
            logger.error("the embedded engine is broken; rebuilding it")
            try:
                engine = self.factory()
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("rebuilding the embedded engine failed; retrying in %.0f s", wait)
                self._send([], 0)
                self._refuse_requests(unavailable, wait)
                wait = min(60.0, wait * 2)
                continue
            self.engine = engine
            self.rebuilds += 1
            self._step_failures = 0
            self.state = READY
            self._send([], 0)
            logger.warning("the embedded engine was rebuilt (%d so far)", self.rebuilds)
            break

    def _refuse_requests(self, error: BaseException, wait: float) -> None:
        """While rebuilding: requests that arrive are answered with `error` (they may retry)."""
        deadline = time.monotonic() + wait
        while not self.stopping.is_set() and (left := deadline - time.monotonic()) > 0:
            request = self._connections.get(left)
            match request:
                case None:
                    break
                case AddRequest(request_id=request_id):
                    self._send([(request_id, error)], 1)
                case Shutdown():
                    self.stopping.set()
