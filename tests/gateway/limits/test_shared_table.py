"""The shared-memory table under the shared limits: bounded, forgetting the least recently updated
key of a probe window, and not stopped by a process that died holding its lock."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator

import pytest

from specgate.gateway.limits import shared_table
from specgate.gateway.limits.shared import SharedLimits
from specgate.gateway.limits.shared_table import TableSpec, layout
from specgate.gateway.settings import Settings


@pytest.fixture
def limits() -> Iterator[SharedLimits]:
    handle = SharedLimits.create(Settings(rate_limit_rpm=60))
    yield handle
    handle.close()


def test_tables_are_bounded_and_forget_the_least_recently_updated() -> None:
    handle = SharedLimits.create(
        Settings(rate_limit_rpm=60), tables=layout(bucket_slots=64, revoked_slots=16)
    )
    try:
        api = handle.attach().api
        for i in range(5000):
            api.take(f"addr-{i}", now=float(i))
        table = api.table
        assert sum(1 for h in table.hashes if h) == 64
        assert table.find(table.key_hash("addr-4999")) >= 0  # the most recent stay
        assert table.find(table.key_hash("addr-0")) < 0
        for _ in range(10):  # a forgotten key starts again with a full bucket
            api.check("addr-0", now=6000.0)
    finally:
        handle.close()


def test_table_specs_are_validated() -> None:
    with pytest.raises(ValueError):
        TableSpec("api", 0, 100)  # not a power of two
    with pytest.raises(ValueError):
        TableSpec("api", 4, 64)  # misaligned
    assert [t.name for t in layout()] == ["api", "refusals", "signins", "revoked", "inflight"]


def _die_holding_the_lock(handle: SharedLimits) -> None:
    handle.lock.acquire()
    os._exit(0)  # killed mid-update: nobody will release it


def test_a_worker_that_dies_holding_the_lock_does_not_stop_the_others(
    limits: SharedLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_table, "STALE_LOCK", 0.2)
    proc = multiprocessing.get_context("spawn").Process(target=_die_holding_the_lock, args=(limits,))
    proc.start()
    proc.join(30)
    api = limits.attach().api
    started = time.monotonic()
    assert api.take("k", now=10.0) == 0.0  # after waiting STALE_LOCK once, this process holds it
    assert 0.2 <= time.monotonic() - started < 5
    started = time.monotonic()
    for _ in range(5):
        api.take("k", now=10.0)
    assert time.monotonic() - started < 0.1  # taken over: released as usual from now on
