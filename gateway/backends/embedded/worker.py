"""The thread that owns the embedded engine and drives `step()`; the event loop never touches torch.

Requests and aborts arrive as commands on a thread-safe queue. Each step's outputs go back to the
event loop in one `call_soon_threadsafe` callback, which puts them on each request's asyncio queue.

The thread supervises its engine. A request the engine refuses, or one that fails inside a step,
fails alone (the engine isolates it). A step that raises fails the requests in flight; when steps
keep failing (`max_step_failures` in a row, counting failed forward passes), the engine is judged
broken and rebuilt from its factory while new requests get 503 with Retry-After, and `state` says
"rebuilding" (so /readyz does). A rebuild that fails is retried with backoff. The loop itself never
dies of an exception; if the thread ends anyway, `alive` turns false and the backend restarts it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from specgate.engine.engine import Engine
from specgate.engine.errors import RequestError
from specgate.engine.outputs import RequestOutput
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams

logger = logging.getLogger("specgate.engine_worker")

Item = RequestOutput | BaseException
READY, REBUILDING = "ready", "rebuilding"


class EngineUnavailable(RuntimeError):
    """The engine is being rebuilt: the request was not served, and may be sent again."""


@dataclass(slots=True)
class Load:
    """The engine's load as of its last step, read by the event loop without locking."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    batch_tokens: int = 0
    step_time: float = 0.0
    steps: int = 0
    kv_blocks_used: int = 0


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        factory: Callable[[], Engine] | None = None,
        *,
        max_step_failures: int = 3,
        rebuild_backoff: float = 1.0,
    ) -> None:
        self.engine = engine
        self.load = Load()
        self.state = READY
        self.last_error: str | None = None
        self.rebuilds = 0
        self._factory = factory
        self._max_step_failures = max_step_failures
        self._rebuild_backoff = rebuild_backoff
        self._step_failures = 0
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[Item]] = {}  # touched on the event loop only
        self._pending = 0  # submitted, not yet taken by the engine thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specgate-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

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
    ) -> asyncio.Queue[Item]:
        """Call on the event loop. Outputs, or the exception that refused the request, arrive on the queue."""
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = q
        self._pending += 1
        self._commands.put(("add", (request_id, prompt_ids, params, spec, cache_scope)))
        return q

    def abort(self, request_id: str) -> None:
        """Call on the event loop: the engine frees the request's blocks before its next step."""
        if self._queues.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    def orphans(self) -> list[str]:
        """Requests the gateway still waits on (event loop only): used when the thread is replaced."""
        return list(self._queues)

    def fail_waiters(self, error: BaseException) -> None:
        """Event loop only: every request still waiting on this worker gets `error`."""
        for request_id in list(self._queues):
            self._queues.pop(request_id).put_nowait(error)

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            deliveries: list[tuple[str, Item]] = []
            taken = 0
            try:
                taken = self._drain(not self.engine.has_unfinished(), deliveries)
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step(deliveries)
            except Exception as exc:  # a bug outside the engine's own isolation: fail what is in flight
                logger.exception("engine step failed; failing the requests in flight")
                deliveries.extend(self._fail_all(exc))
                self._step_failures += 1
            if deliveries or taken:  # before any rebuild: these requests must not wait for it
                self._loop.call_soon_threadsafe(self._deliver, deliveries, taken)
            broken = max(self._step_failures, self.engine.consecutive_forward_failures)
            if broken >= self._max_step_failures:
                self._rebuild()
        if self.engine is not None:  # None when stopped in the middle of a rebuild
            for request_id in self.engine.request_ids():
                self.engine.abort(request_id)

    def _step(self, deliveries: list[tuple[str, Item]]) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t0
        self._step_failures = 0
        for out in outputs:
            deliveries.append((out.request_id, out))
        self._refresh_load(sum(len(o.new_token_ids) for o in outputs), dt)

    def _refresh_load(self, batch_tokens: int, step_time: float) -> None:
        """The load the event loop reads, from the engine as it is now."""
        try:
            stats = self.engine.stats()
        except Exception:
            self.load = Load()
            return
        self.load = Load(
            stats.num_waiting,
            stats.num_running,
            stats.kv_usage,
            batch_tokens,
            step_time,
            self.load.steps + 1,
            stats.kv_blocks_used,
        )

    def _drain(self, block: bool, deliveries: list[tuple[str, Item]]) -> int:
        taken = 0
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0
        while True:
            kind, arg = cmd
            if kind == "add":
                taken += 1
                request_id, prompt_ids, params, spec, scope = arg
                try:
                    self.engine.add_request(request_id, prompt_ids, params, spec, scope)
                except RequestError as exc:
                    deliveries.append((request_id, exc))
                except Exception as exc:  # a bug while admitting one request: that request fails
                    logger.exception("the engine failed to admit request %s", request_id)
                    deliveries.append(
                        (request_id, RuntimeError(f"the engine failed to admit it ({type(exc).__name__})"))
                    )
            elif kind == "abort":
                self.engine.abort(arg)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return taken

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
        self._refresh_load(0, 0.0)
        return [(rid, error) for rid in failed]

    def _rebuild(self) -> None:
        """Replace a broken engine; the requests it held fail with a retryable error."""
        unavailable = EngineUnavailable("the embedded engine failed and is being rebuilt")
        try:
            held = self.engine.request_ids()
        except Exception:
            held = []
        if self._factory is None:
            logger.error("the embedded engine is broken and has no factory to rebuild it from")
            self._step_failures = self.engine.consecutive_forward_failures = 0
            return
        self.state = REBUILDING
        failed: list[tuple[str, Item]] = [(rid, unavailable) for rid in held]
        self._loop.call_soon_threadsafe(self._deliver, failed, 0)
        # Let the broken engine (weights, KV pool) go before the new one is built beside it.
        self.engine = cast(Engine, None)
        self.load = Load()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        wait = self._rebuild_backoff
        while not self._stop.is_set():
            logger.error("the embedded engine is broken; rebuilding it")
            try:
                engine = self._factory()
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("rebuilding the embedded engine failed; retrying in %.0f s", wait)
                self._refuse_commands(unavailable, wait)
                wait = min(60.0, wait * 2)
                continue
            self.engine = engine
            self.rebuilds += 1
            self._step_failures = 0
            self.state = READY
            logger.warning("the embedded engine was rebuilt (%d so far)", self.rebuilds)
            break

    def _refuse_commands(self, error: BaseException, wait: float) -> None:
        """While rebuilding: requests that arrive are answered with `error` (they may retry)."""
        deadline = time.monotonic() + wait
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                kind, arg = self._commands.get(timeout=left)
            except queue.Empty:
                break
            if kind == "add":
                refused: list[tuple[str, Item]] = [(arg[0], error)]
                self._loop.call_soon_threadsafe(self._deliver, refused, 1)

    # ---- event loop ---------------------------------------------------------------------------

    def _deliver(self, deliveries: list[tuple[str, Item]], taken: int) -> None:
        self._pending -= taken
        for request_id, item in deliveries:
            q = self._queues.get(request_id)
            if q is None:
                continue  # aborted by the gateway; nobody is listening
            q.put_nowait(item)
            if isinstance(item, BaseException) or item.finished:
                del self._queues[request_id]
