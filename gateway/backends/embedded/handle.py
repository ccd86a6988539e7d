"""The event loop's side of an engine, wherever it runs: each request's queue, and the engine's load
and state as of the last `Batch`. Touched on the event loop only, so it needs no locks.

Subclasses say how commands reach the engine (`_send`), whether its owner still runs (`alive`), and
how to stop it (`close`); they hand every batch that comes back to `_apply`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.params import SpecParams
from specgate.gateway.backends.embedded.messages import (
    READY,
    Batch,
    Command,
    Item,
    Load,
    LoadFailed,
    Submission,
)
from specgate.gateway.backends.embedded.model_info import ModelInfo


class EngineHandle:
    def __init__(self) -> None:
        self.load = Load()
        self.state = READY
        self.rebuilds = 0
        self.last_error: str | None = None
        self._queues: dict[str, asyncio.Queue[Item]] = {}
        self._pending = 0  # submitted, not yet taken by the engine
        # Requests of each tenant submitted through this handle and not yet finished.
        self.in_engine: Counter[str] = Counter()
        self._tenants: dict[str, str] = {}  # request id -> tenant, while in the engine

    # ---- what a subclass provides ---------------------------------------------------------------

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _send(self, command: Command) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------

    load_error: type[Exception] = RuntimeError  # what `ready` raises when the core cannot load
    _ready: asyncio.Future[ModelInfo]  # set by the subclass: the core's model, once loaded

    def _on_message(self, message: Any) -> None:
        """A message from the engine core: a step's outputs, or its answer to loading the model."""
        if isinstance(message, Batch):
            self._apply(message)
        elif isinstance(message, ModelInfo) and not self._ready.done():
            self._ready.set_result(message)
        elif isinstance(message, LoadFailed) and not self._ready.done():
            self._ready.set_exception(self.load_error(message.error))

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
        self._tenants[request_id] = tenant
        self.in_engine[tenant] += 1
        self._send(
            ("add", Submission(request_id, prompt_ids, params, spec, cache_scope, prefix_salt, tenant))
        )
        return q

    def _forget(self, request_id: str) -> None:
        tenant = self._tenants.pop(request_id, None)
        if tenant is not None:
            self.in_engine[tenant] -= 1
            if not self.in_engine[tenant]:
                del self.in_engine[tenant]

    def abort(self, request_id: str) -> None:
        """The engine frees the request's blocks before its next step."""
        if self._queues.pop(request_id, None) is not None:
            self._forget(request_id)
            self._send(("abort", request_id))

    def orphans(self) -> list[str]:
        """Requests the gateway still waits on."""
        return list(self._queues)

    def fail_waiters(self, error: BaseException) -> None:
        """Every request still waiting on this engine gets `error` (its owner is gone)."""
        for request_id in list(self._queues):
            self._queues.pop(request_id).put_nowait(error)
        self._pending = 0
        self._tenants.clear()
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
            if isinstance(item, BaseException) or item.finished:
                del self._queues[request_id]
                self._forget(request_id)
