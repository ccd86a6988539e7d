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
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from specgate.engine.vocab import LoadSnapshot
from specgate.policies.frozen import freeze

ARM_LOAD = ("load_running", "load_queue", "load_log_batch_tokens", "load_kv_usage", "load_log_step_ms")
MAX_COUNT = 1_000_000


@dataclass(frozen=True, slots=True)
class BackendLoad:
    in_flight: int = 0  # this gateway's requests in flight there, summed over its worker processes
    latency_ewma_ms: float | None = None  # smoothed time to response headers
    healthy: bool = True
    external: bool = True  # False: the embedded engine (its load is the Load's engine fields)
    # From the backend's own /metrics (None: not scraped, or the scrape failed or lied, in which
    # case the gateway's own in-flight count stands in for `num_running`).
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    speculative: bool = False  # it drafts and verifies (declared, or seen in its metrics)
    # Mean accepted tokens per verification step lately, from its speculation counters.
    acceptance_length: float | None = None

    def __post_init__(self) -> None:
        counts = (self.in_flight, self.num_running or 0, self.num_waiting or 0)
        if min(counts) < 0 or max(counts) > MAX_COUNT:
            raise ValueError("backend load counts must be in [0, 1e6]")
        if self.kv_cache_usage is not None and not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError("kv_cache_usage must be in [0, 1]")
        if self.latency_ewma_ms is not None and not 0.0 <= self.latency_ewma_ms < math.inf:
            raise ValueError("latency_ewma_ms must be finite and non-negative")

    @property
    def scraped(self) -> bool:
        return self.num_running is not None

    @property
    def batch(self) -> int:
        """Requests competing for its next steps: running plus waiting as it reports them, but never
        fewer than this gateway's own requests in flight there (a scrape is up to a health interval
        old; what this gateway has sent it is there now)."""
        if self.num_running is None:
            return self.in_flight
        return max(self.in_flight, self.num_running + (self.num_waiting or 0))

    def features(self) -> dict[str, float]:
        running = self.batch - (self.num_waiting or 0)
        return {
            "load_running": float(running),
            "load_queue": float(self.num_waiting or 0),
            "load_log_batch_tokens": 0.0,  # an external server's tokens per step are not known
            "load_kv_usage": float(self.kv_cache_usage or 0.0),
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
        scraped = [m for m in up if m.num_running is not None]
        latencies = [m.latency_ewma_ms for m in up if m.latency_ewma_ms is not None]
        kv = [m.kv_cache_usage for m in up if m.kv_cache_usage is not None]
        accept = [m.acceptance_length for m in up if m.acceptance_length is not None]
        return cls(
            in_flight=round(sum(m.in_flight for m in up) / n),
            latency_ewma_ms=sum(latencies) / len(latencies) if latencies else None,
            healthy=any(m.healthy for m in members),
            # Each replica's batch as it is known (scraped, else this gateway's count there).
            num_running=min(MAX_COUNT, round(sum(m.batch for m in up) / n)) if scraped else None,
            num_waiting=0 if scraped else None,
            kv_cache_usage=sum(kv) / len(kv) if kv else None,
            speculative=any(m.speculative for m in up),
            acceptance_length=sum(accept) / len(accept) if accept else None,
        )


@dataclass(frozen=True, slots=True)
class Load:
    # The embedded engine's, as of its last step (None: no embedded engine reported; its features
    # are then zeros).
    engine: LoadSnapshot | None = None
    # Per backend name, and per replica group name (the group's arm): its load.
    backends: Mapping[str, BackendLoad] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backends", freeze(self.backends))

    @property
    def batch(self) -> int:
        """Sequences competing for the embedded engine's next steps: running plus waiting."""
        return self.engine.batch if self.engine is not None else 0

    def batch_of(self, backend: str) -> int:
        """The batch an arm on `backend` joins: the engine's, or the external backend's."""
        b = self.backends.get(backend)
        return b.batch if b is not None and b.external else self.batch

    def engine_features(self) -> dict[str, float]:
        e = self.engine or LoadSnapshot()
        return {
            "load_running": float(e.num_running),
            "load_queue": float(e.num_waiting),
            "load_log_batch_tokens": math.log1p(e.num_batched_tokens),
            "load_kv_usage": float(e.kv_cache_usage),
            "load_log_step_ms": math.log1p(e.step_time * 1e3),
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
                num_running=min(MAX_COUNT, max(0, round(get("load_running")))),
                num_waiting=min(MAX_COUNT, max(0, round(get("load_queue")))),
                kv_cache_usage=min(1.0, max(0.0, get("load_kv_usage"))),
                latency_ewma_ms=max(0.0, math.expm1(min(50.0, get("load_log_step_ms")))),
            )

        def engine(n: str, cap: float) -> float:
            v = float(features.get(n, 0.0))
            return min(cap, max(0.0, v)) if math.isfinite(v) else 0.0

        snapshot = LoadSnapshot(
            num_waiting=round(engine("load_queue", MAX_COUNT)),
            num_running=round(engine("load_running", MAX_COUNT)),
            num_batched_tokens=round(math.expm1(engine("load_log_batch_tokens", 20.0))),
            kv_cache_usage=engine("load_kv_usage", 1.0),
            step_time=math.expm1(engine("load_log_step_ms", 20.0)) / 1e3,
        )
        return cls(engine=snapshot, backends=backends)


def arm_input(features: dict[str, float], backend: str) -> dict[str, float]:
    """A row's (or a decision's) features as the model of an arm on `backend` reads them: the
    backend's own load under the plain load names where the row recorded it."""
    own = {k: features[f"{backend}:{k}"] for k in ARM_LOAD if f"{backend}:{k}" in features}
    return {**features, **own} if own else features
