"""The load at decision time: the embedded engine's batch and each external backend's state.

The router reads it, the request's record keeps it (its row's load columns come from it), and
offline evaluation rebuilds its engine part from a row's features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class BackendLoad:
    in_flight: int = 0
    latency_ewma_ms: float | None = None
    healthy: bool = True


@dataclass(slots=True)
class Load:
    queue_depth: int = 0  # embedded requests waiting for a batch slot
    running: int = 0  # embedded sequences in the running batch
    batch_tokens: int = 0  # tokens the last engine step produced
    kv_usage: float = 0.0  # share of KV blocks in use
    step_ms: float = 0.0  # the last engine step's wall time
    backends: dict[str, BackendLoad] = field(default_factory=dict)
    engine: bool = False  # an embedded engine reported the fields above (else they are zeros)

    def __post_init__(self) -> None:
        if min(self.queue_depth, self.running, self.batch_tokens) < 0 or self.step_ms < 0:
            raise ValueError("load signals must be non-negative")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError("kv_usage must be in [0, 1]")

    @property
    def batch(self) -> int:
        """Sequences competing for the next steps: running plus waiting."""
        return self.running + self.queue_depth

    def features(self) -> dict[str, float]:
        return {
            "load_running": float(self.running),
            "load_queue": float(self.queue_depth),
            "load_log_batch_tokens": math.log1p(self.batch_tokens),
            "load_kv_usage": float(self.kv_usage),
            "load_log_step_ms": math.log1p(self.step_ms),
        }

    @classmethod
    def from_features(cls, features: dict[str, float]) -> Load:
        """The embedded part of the load back from a telemetry row's features (offline evaluation)."""
        return cls(
            queue_depth=int(features.get("load_queue", 0)),
            running=int(features.get("load_running", 0)),
            batch_tokens=round(math.expm1(features.get("load_log_batch_tokens", 0.0))),
            kv_usage=min(1.0, max(0.0, float(features.get("load_kv_usage", 0.0)))),
            step_ms=max(0.0, math.expm1(features.get("load_log_step_ms", 0.0))),
        )
