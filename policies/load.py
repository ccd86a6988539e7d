"""The load at decision time: the embedded engine's batch and each external backend's state.

The router reads it, the request's record keeps it (its row's load columns and features come from
it), and offline evaluation rebuilds it from a row's features.

Every arm's goodput model reads the same five load features (`ARM_LOAD`), each about the arm's own
backend: the engine's batch for the embedded engine's arms; for an external backend (or a replica
group, one arm), its requests running and waiting as its /metrics say (else this gateway's own
requests in flight there), its KV-cache use and its recent latency. A row records them for every
backend the request could have gone to (`<backend>:load_running`, ...), so that a policy can be
evaluated offline on arms the logged one did not take.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

ARM_LOAD = ("load_running", "load_queue", "load_log_batch_tokens", "load_kv_usage", "load_log_step_ms")
MAX_COUNT = 1_000_000


@dataclass(slots=True)
class BackendLoad:
    in_flight: int = 0  # this gateway's requests in flight there, summed over its worker processes
    latency_ewma_ms: float | None = None  # smoothed time to response headers
    healthy: bool = True
    external: bool = True  # False: the embedded engine (its load is the Load's engine fields)
    # From the backend's own /metrics (None: not scraped, or the scrape failed or lied, in which
    # case the gateway's own in-flight count stands in for `running`).
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    speculative: bool = False  # it drafts and verifies (declared, or seen in its metrics)
    # Mean accepted tokens per verification step lately, from its speculation counters.
    acceptance_length: float | None = None

    def __post_init__(self) -> None:
        counts = (self.in_flight, self.running or 0, self.waiting or 0)
        if min(counts) < 0 or max(counts) > MAX_COUNT:
            raise ValueError("backend load counts must be in [0, 1e6]")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError("kv_usage must be in [0, 1]")
        if self.latency_ewma_ms is not None and not 0.0 <= self.latency_ewma_ms < math.inf:
            raise ValueError("latency_ewma_ms must be finite and non-negative")

    @property
    def scraped(self) -> bool:
        return self.running is not None

    @property
    def batch(self) -> int:
        """Requests competing for its next steps: running plus waiting as it reports them, but never
        fewer than this gateway's own requests in flight there (a scrape is up to a health interval
        old; what this gateway has sent it is there now)."""
        if self.running is None:
            return self.in_flight
        return max(self.in_flight, self.running + (self.waiting or 0))

    def features(self) -> dict[str, float]:
        running = self.batch - (self.waiting or 0)
        return {
            "load_running": float(running),
            "load_queue": float(self.waiting or 0),
            "load_log_batch_tokens": 0.0,  # an external server's tokens per step are not known
            "load_kv_usage": float(self.kv_usage or 0.0),
            "load_log_step_ms": math.log1p(self.latency_ewma_ms or 0.0),
        }

    @classmethod
    def combine(cls, members: list[BackendLoad]) -> BackendLoad:
        """A replica group's load as one arm: the mean over its healthy replicas (the request lands
        on one of them), healthy if any is."""
        if not members:
            raise ValueError("a replica group needs members")
        up = [m for m in members if m.healthy] or members
        n = len(up)
        scraped = [m for m in up if m.running is not None]
        latencies = [m.latency_ewma_ms for m in up if m.latency_ewma_ms is not None]
        kv = [m.kv_usage for m in up if m.kv_usage is not None]
        accept = [m.acceptance_length for m in up if m.acceptance_length is not None]
        return cls(
            in_flight=round(sum(m.in_flight for m in up) / n),
            latency_ewma_ms=sum(latencies) / len(latencies) if latencies else None,
            healthy=any(m.healthy for m in members),
            # Each replica's batch as it is known (scraped, else this gateway's count there).
            running=min(MAX_COUNT, round(sum(m.batch for m in up) / n)) if scraped else None,
            waiting=0 if scraped else None,
            kv_usage=sum(kv) / len(kv) if kv else None,
            speculative=any(m.speculative for m in up),
            acceptance_length=sum(accept) / len(accept) if accept else None,
        )


@dataclass(slots=True)
class Load:
    queue_depth: int = 0  # embedded requests waiting for a batch slot
    running: int = 0  # embedded sequences in the running batch
    batch_tokens: int = 0  # tokens the last engine step produced
    kv_usage: float = 0.0  # share of KV blocks in use
    step_ms: float = 0.0  # the last engine step's wall time
    # Per backend name, and per replica group name (the group's arm): its load.
    backends: dict[str, BackendLoad] = field(default_factory=dict)
    engine: bool = False  # an embedded engine reported the fields above (else they are zeros)

    def __post_init__(self) -> None:
        if min(self.queue_depth, self.running, self.batch_tokens) < 0 or self.step_ms < 0:
            raise ValueError("load signals must be non-negative")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError("kv_usage must be in [0, 1]")

    @property
    def batch(self) -> int:
        """Sequences competing for the embedded engine's next steps: running plus waiting."""
        return self.running + self.queue_depth

    def batch_of(self, backend: str) -> int:
        """The batch an arm on `backend` joins: the engine's, or the external backend's."""
        b = self.backends.get(backend)
        return b.batch if b is not None and b.external else self.batch

    def engine_features(self) -> dict[str, float]:
        return {
            "load_running": float(self.running),
            "load_queue": float(self.queue_depth),
            "load_log_batch_tokens": math.log1p(self.batch_tokens),
            "load_kv_usage": float(self.kv_usage),
            "load_log_step_ms": math.log1p(self.step_ms),
        }

    def arm_features(self, backend: str) -> dict[str, float]:
        """The load features of an arm on `backend` (a backend or a replica group's name)."""
        b = self.backends.get(backend)
        return b.features() if b is not None and b.external else self.engine_features()

    def features(self, backends: Collection[str] | None = None) -> dict[str, float]:
        """What a row records: the engine's load under the plain names, and each external backend's
        (of `backends` only, where given: a request's candidate pools) under `<backend>:<name>`."""
        out = self.engine_features()
        for name, b in self.backends.items():
            if b.external and (backends is None or name in backends):
                out.update({f"{name}:{k}": v for k, v in b.features().items()})
        return out

    @classmethod
    def from_features(cls, features: dict[str, float]) -> Load:
        """The load back from a telemetry row's features (offline evaluation): the engine's part, and
        each external backend's as its features say (the counts as running / waiting)."""
        backends: dict[str, BackendLoad] = {}
        for key in features:
            name, sep, feature = key.rpartition(":")
            if not sep or feature != "load_running":
                continue

            def get(n: str, name: str = name) -> float:
                v = features.get(f"{name}:{n}", 0.0)
                return v if math.isfinite(v) else 0.0

            backends[name] = BackendLoad(
                running=min(MAX_COUNT, max(0, round(get("load_running")))),
                waiting=min(MAX_COUNT, max(0, round(get("load_queue")))),
                kv_usage=min(1.0, max(0.0, get("load_kv_usage"))),
                latency_ewma_ms=max(0.0, math.expm1(min(50.0, get("load_log_step_ms")))),
            )

        def engine(n: str, cap: float) -> float:
            v = float(features.get(n, 0.0))
            return min(cap, max(0.0, v)) if math.isfinite(v) else 0.0

        return cls(
            queue_depth=round(engine("load_queue", MAX_COUNT)),
            running=round(engine("load_running", MAX_COUNT)),
            batch_tokens=round(math.expm1(engine("load_log_batch_tokens", 20.0))),
            kv_usage=engine("load_kv_usage", 1.0),
            step_ms=math.expm1(engine("load_log_step_ms", 20.0)),
            backends=backends,
        )


def arm_input(features: dict[str, float], backend: str) -> dict[str, float]:
    """A row's (or a decision's) features as the model of an arm on `backend` reads them: the
    backend's own load under the plain load names where the row recorded it."""
    own = {k: features[f"{backend}:{k}"] for k in ARM_LOAD if f"{backend}:{k}" in features}
    return {**features, **own} if own else features
