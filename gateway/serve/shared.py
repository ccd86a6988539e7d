"""What the supervisor of `specgate serve --workers N` starts once for all of its workers, besides
the engine core (supervisor.py): the hook points of the shared telemetry writer and limit tables.

`start_shared` runs before any worker is spawned; what it returns goes into every worker's
`WorkerContext`, and its closer runs once after the last worker has exited (the workers may use
what it started until then).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.relay import RecordRelayServer
from specgate.gateway.telemetry.store import TelemetryStore

logger = logging.getLogger("specgate.serve")


def start_shared(settings: Settings, run_dir: str) -> tuple[str | None, Any, Callable[[], None]]:
    """(telemetry socket, shared limits handle, closer)."""
    closers: list[Callable[[], None]] = []
    telemetry_socket: str | None = None
    # HOOK (telemetry relay, gateway/telemetry/relay.py): the one telemetry writer, here; the
    # workers' stores send it their records. Closed in reverse: the relay drains the workers'
    # connections first, then the store flushes every queued row.
    if settings.telemetry.enabled:
        store = TelemetryStore(settings.telemetry)
        store.open()  # the schema was checked (or upgraded) by the preflight just before
        if store.writer is not None:
            store.writer.yield_cpu()  # inserts wait for idle CPU rather than delay requests
        closers.append(store.close)
        # So do the workers' records on their way in (each worker waits for its acknowledgement in
        # a thread of its own, never on its event loop).
        relay = RecordRelayServer(store, os.path.join(run_dir, "telemetry.sock"), idle=True).start()
        closers.append(relay.close)
        telemetry_socket = relay.path

    # HOOK (shared limits, gateway/limits/shared.py): one segment, created with the context the
    # workers are spawned with (its lock can only travel in spawn arguments); unlinked at the end.
    limits = SharedLimits.create(settings, multiprocessing.get_context("spawn"))
    closers.append(limits.close)

    def close() -> None:
        for closer in reversed(closers):
            try:
                closer()
            except Exception:
                logger.exception("closing a shared part of the workers failed")

    return telemetry_socket, limits, close
