"""What is known of one inference request while it runs, and the one record it leaves.

Each part is set by the stage that owns it: the context by the middleware, the caller and the body
by the inference route, the load, the route decision and the backend call (whose `Observation` the
backend fills) by the serving pipeline. `finish` builds the request's `RequestRecord` from them
once, when the middleware knows what the client actually got; nothing else constructs a record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Literal

from specgate.gateway.backends.base import BackendCall, Observation
from specgate.gateway.backends.relay import RelayCall
from specgate.gateway.protocol.route import RouteDecision
from specgate.gateway.request.context import Caller, RequestContext
from specgate.gateway.telemetry.records import RequestRecord
from specgate.policies.load import Load

Outcome = Literal["ok", "error", "cancelled"]


@dataclass(slots=True)
class RequestTracker:
    context: RequestContext
    caller: Caller | None = None
    model: str = "unknown"  # the body's `model` as sent, known even when the body is refused
    body_bytes: int = 0
    stream: bool = False
    load: Load | None = None  # the load the router saw
    decision: RouteDecision | None = None  # as the router planned it (dispatch names who served)
    # The prompt's block hashes where prefix affinity read them: for the affinity to learn from once
    # the request is over, never recorded.
    prefix_blocks: tuple[int, ...] | None = None
    call: BackendCall | RelayCall | None = None  # a RelayCall: a pass-through (embeddings, rerank)
    overhead_ms: float | None = None  # gateway time before the backend was called
    outcome: Outcome = "ok"  # decided along the way only by what the status cannot tell
    error_code: str | None = None
    ended_at: float | None = None  # when the backend side closed

    def asked(self, model: Any, body_bytes: int) -> None:
        """The body is in: its size, and the model it names (if it names one)."""
        self.body_bytes = body_bytes
        if isinstance(model, str):
            self.model = model

    def cancelled(self, code: str | None = None) -> None:
        """The client left (before its answer, or during a stream); a failure already noted stands."""
        if self.outcome == "ok":
            self.outcome = "cancelled"
            self.error_code = self.error_code or code

    def failed(self, code: str | None) -> None:
        """The request failed after its status was sent (a stream that broke after its 200)."""
        self.outcome = "error"
        self.error_code = self.error_code or code

    def refused(self, code: str | None) -> None:
        """Why an error answer was sent (its status decides the outcome)."""
        self.error_code = self.error_code or code

    def ended(self) -> None:
        if self.ended_at is None:
            self.ended_at = time.time()

    def _route(self) -> RouteDecision | None:
        """The route as served (dispatch's, naming the backend), else as planned."""
        served = getattr(self.call, "route", None)
        return served if isinstance(served, RouteDecision) else self.decision

    def finish(self, status: int | None, escaped: BaseException | None) -> RequestRecord:
        """The record, from what the client actually got: `status` as sent (None: no response
        started) and the exception that escaped the app, if any. An outcome decided along the way
        (a stream that failed or was abandoned after its 200) stands."""
        if status is None:
            cancelled = escaped is None or isinstance(escaped, asyncio.CancelledError)
            status = 499 if cancelled else 500  # 499: the client left before any answer
        outcome, error_code = self.outcome, self.error_code
        if outcome == "ok" and status == 499:
            outcome = "cancelled"
        elif outcome == "ok" and status >= 400:
            outcome = "error"
        if error_code is None and status == 413:
            error_code = "request_too_large"
        if outcome == "error" and error_code is None and status >= 500:
            error_code = "internal_error"
        ctx = self.context
        obs = self.call.observed if self.call is not None else Observation()
        return RequestRecord(
            request_id=ctx.request_id,
            endpoint=ctx.endpoint,
            model=self.model,
            arrival_time=ctx.arrival_time,
            stream=self.stream,
            api_key_id=self.caller.key_id if self.caller is not None else None,
            client_request_id=ctx.client_request_id,
            backend=obs.backend or None,
            route=self._route(),
            status=status,
            outcome=outcome,
            error_code=error_code,
            finish_reason=obs.finish_reason,
            prompt_tokens=obs.prompt_tokens,
            completion_tokens=obs.completion_tokens,
            cached_tokens=obs.cached_tokens,
            first_token_time=obs.first_token_time,
            # A stream's TPOT is measured here; only a whole answer needs the backend's own.
            backend_tpot_ms=None if obs.backend_tpot is None or self.stream else obs.backend_tpot * 1e3,
            finished_time=self.ended_at or time.time(),
            queue_time_ms=None if obs.queue_time is None else obs.queue_time * 1e3,
            attempts=obs.attempts,
            load=self.load,
            spec_decoding=obs.spec_decoding,
            grammar=obs.grammar,
            upstream=obs.upstream,
            overhead_ms=self.overhead_ms,
            spec_steps=obs.spec_steps,
            n=obs.n,
        )
