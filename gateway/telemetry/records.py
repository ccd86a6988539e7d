"""One record per request: who asked, how it was routed, how it went. Handed to the sinks when it ends.

Immutable, nested values included: built once, when the request is over (`request/tracker.py`),
from what each stage produced. The sinks: recent records in memory (`MemorySink`), Prometheus, the
telemetry store (which persists the record as rows, `rows.py`). Submitting never blocks the request
path.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from specgate.engine.vocab import SpecStep
from specgate.gateway.protocol.route import RouteDecision
from specgate.policies.decision import Slo
from specgate.policies.frozen import freeze
from specgate.policies.load import Load


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    endpoint: str  # "chat" | "completion" | "embeddings" | "rerank"
    model: str
    arrival_time: float  # unix seconds
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
    first_token_time: float | None = None  # None: unknown (see Observation.first_token_time)
    # Time per output token as the backend measured it (a non-streamed external call); None: taken
    # from first_token_time and finished_time, or unknown.
    backend_tpot_ms: float | None = None
    finished_time: float | None = None
    queue_time_ms: float | None = None
    attempts: int = 0
    load: Load | None = None  # what the router saw at arrival
    spec_decoding: Mapping[str, Any] | None = None
    # The output constraint's kind (engine/structured_output/grammar.py KINDS); None: none.
    grammar: str | None = None
    upstream: Mapping[str, Any] = field(default_factory=dict)
    overhead_ms: float | None = None  # gateway time before the backend was called
    spec_steps: Sequence[SpecStep] = ()  # per verification step
    # Choices generated (n > 1 on the embedded engine): the token counts cover them all, so the time
    # per output token divides by each choice's share. Not a column: the row does not keep it.
    n: int = 1

    def __post_init__(self) -> None:
        # The route and the load are frozen dataclasses that freeze their own collections.
        for name in ("spec_decoding", "upstream", "spec_steps"):
            object.__setattr__(self, name, freeze(getattr(self, name)))

    @property
    def workload_class(self) -> str | None:
        """The class a classifying router gave the request (None: static routing, or not routed)."""
        return self.route.workload_class if self.route is not None else None

    @property
    def class_confidence(self) -> float | None:
        return self.route.class_confidence if self.route is not None else None

    @property
    def features(self) -> Mapping[str, Any]:
        """What the routing policy saw."""
        return self.route.features if self.route is not None else {}

    @property
    def cancelled(self) -> bool:
        return self.outcome == "cancelled"

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_time is None else (self.first_token_time - self.arrival_time) * 1e3

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finished_time is None else (self.finished_time - self.arrival_time) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        if self.backend_tpot_ms is not None:
            return self.backend_tpot_ms
        # n > 1 choices decode side by side: each choice's tokens, not their sum, take the time.
        n = (self.completion_tokens or 0) / max(1, self.n)
        if self.first_token_time is None or self.finished_time is None or n < 2:
            return None
        return (self.finished_time - self.first_token_time) * 1e3 / (n - 1)

    @property
    def slo_met(self) -> bool | None:
        """Whether the request met its latency targets (None: it had none, or a latency it had a
        target for is unknown, or it did not finish)."""
        slo = self.route.slo if self.route is not None else None
        if not slo or self.outcome != "ok":
            return None
        # The policy's own measure, on what happened instead of what it predicted.
        headroom = Slo(**slo).headroom(self.ttft_ms, self.tpot_ms)
        return None if headroom is None else headroom >= 1.0

    @property
    def tokens_per_s(self) -> float | None:
        e2e = self.e2e_ms
        return None if not e2e or self.completion_tokens is None else self.completion_tokens / (e2e / 1e3)


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
