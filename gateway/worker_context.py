"""What one process of `specgate serve --workers N` shares with its siblings.

`specgate serve` runs a supervisor process that starts the shared parts once (the embedded engine
core, the telemetry writer, the shared-memory limit tables, the Prometheus multiprocess directory)
and hands each of its N workers (one by default) this picklable description of where they are.
An app built without one (tests, `--engine-thread`) is one process holding all of its state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerContext:
    index: int  # this worker's number, 0 .. workers - 1
    workers: int
    run_dir: str  # the supervisor's private directory: sockets and metric files live here
    engine_socket: str | None = None  # Unix socket of the shared engine core; None: no embedded engine
    telemetry_socket: str | None = None  # Unix socket of the one telemetry writer; None: telemetry off
    metrics_dir: str | None = None  # PROMETHEUS_MULTIPROC_DIR, set before prometheus_client is imported
    shared_limits: Any = None  # the shared-memory limit tables (gateway/limits/shared.py), attached by name

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("a worker context needs at least one worker")
        if not 0 <= self.index < self.workers:
            raise ValueError(f"worker index {self.index} is outside 0..{self.workers - 1}")
