"""Idle CPU priority for the supervisor's telemetry threads: real threads, checked with the OS."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from specgate.gateway.telemetry.idle_cpu import yield_cpu
from specgate.gateway.telemetry.schema import make_engine
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _policy_in_thread(lower: bool) -> int:
    seen: list[int] = []

    def run() -> None:
        if lower:
            assert yield_cpu(what="test thread")
        seen.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_the_calling_thread_alone_goes_idle() -> None:
    assert _policy_in_thread(lower=True) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this thread (the process's) is untouched
    assert _policy_in_thread(lower=False) == os.SCHED_OTHER


def test_the_writer_thread_goes_idle(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 't.db'}")
    writer = TelemetryWriter(engine, Spool(tmp_path / "spool"))
    writer.start()
    try:
        native_id = writer._thread.native_id
        assert native_id is not None and os.sched_getscheduler(native_id) == os.SCHED_OTHER
        writer.yield_cpu()
        assert os.sched_getscheduler(native_id) == os.SCHED_IDLE
    finally:
        writer.close(5)
        engine.dispose()
