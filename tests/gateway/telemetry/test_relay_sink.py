"""A worker's relay sink on its own: never blocking, bounded, counting what it loses."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from specgate.gateway.telemetry.relay_sink import RelaySink
from tests.gateway.telemetry.test_relay import record


def test_an_overflowing_backlog_counts_its_drops(tmp_path: Path) -> None:
    sink = RelaySink(
        str(tmp_path / "nobody.sock"), max_backlog=5, max_backoff=0.05, close_timeout=0.2
    ).start()
    started = time.perf_counter()
    for i in range(12):
        sink.submit(record(f"r{i}"))
    assert time.perf_counter() - started < 0.5  # never waits for the relay
    assert sink.counters.dropped == 7 and sink.queue_size() == 5
    sink.close()  # gives up after close_timeout: those are counted too
    assert sink.counters.dropped == 12


def test_settings_are_validated(tmp_path: Path) -> None:
    for bad in ({"batch_size": 0}, {"flush_interval": 0.0}, {"max_backlog": 0}, {"max_backoff": 0.0}):
        with pytest.raises(ValueError):
            RelaySink(str(tmp_path / "s.sock"), **bad)  # type: ignore[arg-type]


def test_close_without_start_or_records(tmp_path: Path) -> None:
    sink = RelaySink(str(tmp_path / "s.sock"))
    sink.close()
    assert sink.counters.dropped == 0
