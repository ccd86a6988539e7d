"""The writer's inbox: rows in without waking the writer each time, out in batches, none lost."""

from __future__ import annotations

import threading
import time

import pytest

from specgate.gateway.telemetry.inbox import Inbox, InboxFull


def test_a_put_below_a_batch_does_not_wake_the_writer() -> None:
    inbox = Inbox(maxsize=10, batch_size=3)
    inbox.put_nowait({"r": 1})
    inbox.put_nowait({"r": 2})
    assert not inbox.ready.is_set()
    inbox.put_nowait({"r": 3})
    assert inbox.ready.is_set()  # a full batch does


def test_the_writer_waits_out_its_interval_unless_woken() -> None:
    inbox = Inbox(maxsize=10, batch_size=100)
    inbox.put_nowait({"r": 1})
    started = time.monotonic()
    inbox.wait(0.2)
    assert time.monotonic() - started >= 0.18
    threading.Timer(0.05, inbox.wake).start()
    started = time.monotonic()
    inbox.wait(5.0)
    assert time.monotonic() - started < 2.0


def test_batches_keep_order_bound_and_count_what_is_unfinished() -> None:
    inbox = Inbox(maxsize=4, batch_size=2)
    for i in range(4):
        inbox.put_nowait({"r": i})
    with pytest.raises(InboxFull):
        inbox.put_nowait({"r": 4})
    assert inbox.unfinished == 4 and inbox.qsize() == 4
    first = inbox.take(3)
    assert [e["r"] for e in first] == [0, 1, 2] and inbox.unfinished == 4
    inbox.done(len(first))
    assert inbox.unfinished == 1 and [e["r"] for e in inbox.take(3)] == [3] and inbox.empty()


def test_rows_from_another_thread_all_arrive() -> None:
    inbox = Inbox(maxsize=100_000, batch_size=64)
    got: list[int] = []

    def writer() -> None:
        while len(got) < 20_000:
            inbox.wait(0.01)
            batch = inbox.take(64)
            got.extend(e["r"] for e in batch)
            inbox.done(len(batch))

    t = threading.Thread(target=writer)
    t.start()
    for i in range(20_000):
        inbox.put_nowait({"r": i})
    t.join(30)
    assert got == list(range(20_000)) and inbox.unfinished == 0
