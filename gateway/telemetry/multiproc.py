"""Prometheus multiprocess mode for `specgate serve --workers N`: where the workers' metric files
are, and the registry that reads them all."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_view() -> CollectorRegistry:
    """A registry that sums every worker's files. Refuses a process where prometheus_client chose
    its in-memory values (the directory was set after it was imported): /metrics would then show
    this worker's numbers alone, silently."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path or values.ValueClass is values.MutexValue:
        raise RuntimeError(
            f"multiprocess metrics need {MULTIPROC_ENV} set before prometheus_client is imported"
        )
    view = CollectorRegistry()
    MultiProcessCollector(view, path)
    return view


def forget_process(pid: int, path: str) -> None:
    """A worker exited: its live gauges (in flight, ...) stop counting; its counters stay in the sums."""
    mark_process_dead(pid, path)
