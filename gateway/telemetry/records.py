"""One record per request: who asked, how it was routed, how it went. Handed to a sink when it ends.

The sink is a seam: in memory here (recent records, for tests and the admin API); the telemetry
store persists them. Submitting never blocks the request path.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from specgate.gateway.protocol.route import RouteDecision


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    endpoint: str  # "chat" | "completion"
    model: str
    received_at: float  # unix seconds
    stream: bool
    api_key_id: str | None = None  # a hash prefix of the key, never the key
    # The client's own x-request-id, kept as sent (it may repeat); `request_id` is the gateway's.
    client_request_id: str | None = None
    backend: str | None = None
    route: RouteDecision | None = None
    status: int = 0  # HTTP status sent (200 for streams that started, even if they failed later)
    outcome: str = "ok"  # ok | error | cancelled
    error_code: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Prompt tokens served from the backend's prefix cache; None when the backend does not say.
    cached_tokens: int | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    queue_ms: float | None = None
    attempts: int = 0
    load: dict[str, Any] = field(default_factory=dict)  # load at arrival
    spec: dict[str, Any] | None = None
    upstream: dict[str, Any] = field(default_factory=dict)
    overhead_ms: float | None = None  # gateway time before the backend was called
    workload_class: str | None = None  # set by a classifying router
    class_confidence: float | None = None
    features: dict[str, Any] = field(default_factory=dict)  # what the routing policy saw
    # Per verification step: (k proposed, accepted, batch tokens, forward ms); embedded engine only.
    # Per verification step: drafted tokens (tree nodes), accepted, batch tokens, forward ms, draft depth.
    spec_steps: list[tuple[int, int, int, float, int]] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.outcome == "cancelled"

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_at is None else (self.first_token_at - self.received_at) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finished_at is None else (self.finished_at - self.received_at) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        n = self.completion_tokens or 0
        if self.first_token_at is None or self.finished_at is None or n < 2:
            return None
        return (self.finished_at - self.first_token_at) * 1e3 / (n - 1)

    @property
    def tokens_per_s(self) -> float | None:
        e2e = self.e2e_ms
        return None if not e2e or self.completion_tokens is None else self.completion_tokens / (e2e / 1e3)

    def finish(self) -> None:
        self.finished_at = time.time()


def settle(rec: RequestRecord, status: int | None, escaped: BaseException | None) -> None:
    """Complete `rec` from what the client actually got: `status` as sent (None: no response
    started) and the exception that escaped the app, if any. Outcomes already decided along the way
    (a stream that failed or was abandoned after its 200) stand."""
    if status is not None:
        rec.status = status
    elif escaped is None or isinstance(escaped, asyncio.CancelledError):
        rec.status = rec.status or 499  # the client left before any answer
    else:
        rec.status = 500
    if rec.outcome == "ok":
        if rec.status == 499:
            rec.outcome = "cancelled"
        elif rec.status >= 400:
            rec.outcome = "error"
    if rec.outcome == "error" and rec.error_code is None and rec.status >= 500:
        rec.error_code = "internal_error"
    if rec.finished_at is None:
        rec.finish()


class RecordSink(Protocol):
    def submit(self, record: RequestRecord) -> None: ...


class MemorySink:
    """The most recent records, oldest dropped first."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.records: collections.deque[RequestRecord] = collections.deque(maxlen=capacity)

    def submit(self, record: RequestRecord) -> None:
        self.records.append(record)

    def find(self, request_id: str) -> RequestRecord | None:
        """The newest record with this gateway id, or else with this client x-request-id."""
        for r in reversed(self.records):
            if request_id in (r.request_id, r.client_request_id):
                return r
        return None
