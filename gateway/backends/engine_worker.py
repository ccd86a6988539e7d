"""The thread that owns the embedded engine and drives `step()`; the event loop never touches torch.

Requests and aborts arrive as commands on a thread-safe queue. Each step's outputs go back to the
event loop in one `call_soon_threadsafe` callback, which puts them on each request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.engine import Engine
from engine.errors import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.params import SpecParams

logger = logging.getLogger("specgate.engine_worker")

Item = RequestOutput | BaseException


@dataclass(slots=True)
class Load:
    """The engine's load as of its last step, read by the event loop without locking."""

    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    batch_tokens: int = 0
    step_time: float = 0.0
    steps: int = 0


class EngineWorker:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.load = Load()
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
    def num_waiting(self) -> int:
        """Requests not yet running: waiting in the engine, or submitted and not yet taken."""
        return self.load.num_waiting + self._pending

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, spec: SpecParams | None
    ) -> asyncio.Queue[Item]:
        """Call on the event loop. Outputs, or the exception that refused the request, arrive on the queue."""
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[request_id] = q
        self._pending += 1
        self._commands.put(("add", (request_id, prompt_ids, params, spec)))
        return q

    def abort(self, request_id: str) -> None:
        """Call on the event loop: the engine frees the request's blocks before its next step."""
        if self._queues.pop(request_id, None) is not None:
            self._commands.put(("abort", request_id))

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished()
            deliveries: list[tuple[str, Item]] = []
            taken = self._drain(block, deliveries)
            if self._stop.is_set():
                break
            if engine.has_unfinished():
                t0 = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug or OOM: fail what is in flight, keep serving
                    logger.exception("engine step failed; aborting in-flight requests")
                    deliveries.extend(self._fail_all(exc))
                    outputs = []
                dt = time.perf_counter() - t0
                deliveries.extend((out.request_id, out) for out in outputs)
                stats = engine.stats()
                self.load = Load(
                    stats.num_waiting,
                    stats.num_running,
                    stats.kv_usage,
                    sum(len(o.new_token_ids) for o in outputs),
                    dt,
                    self.load.steps + 1,
                )
            if deliveries or taken:
                self._loop.call_soon_threadsafe(self._deliver, deliveries, taken)
        for request_id in engine.request_ids():
            engine.abort(request_id)

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
                request_id, prompt_ids, params, spec = arg
                try:
                    self.engine.add_request(request_id, prompt_ids, params, spec)
                except RequestError as exc:
                    deliveries.append((request_id, exc))
            elif kind == "abort":
                self.engine.abort(arg)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return taken

    def _fail_all(self, exc: Exception) -> list[tuple[str, Item]]:
        failed = self.engine.request_ids()
        for request_id in failed:
            self.engine.abort(request_id)
        try:
            self.engine.step()  # collects the aborts so their blocks are freed
        except Exception:
            logger.exception("engine cleanup after a failed step also failed")
        error = RuntimeError(f"engine step failed: {type(exc).__name__}")
        return [(rid, error) for rid in failed]

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
