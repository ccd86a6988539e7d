"""Telemetry on its way out of the event loop, to a thread that sends it on, without a wake-up each:
the writer's rows (writer.py) and a worker's records for the supervisor (relay_sink.py).

A `queue.Queue` notifies its consumer on every put: one thread switch (and a GIL hand-over) per
request on the event loop's critical path, measured at an eighth of the gateway's CPU per request
when requests come one at a time. Here a put is a deque append; the writer wakes for a full batch,
for `close`/`flush`, or at its flush interval, whichever comes first.
"""

from __future__ import annotations

import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class InboxFull(Exception):
    pass


class Inbox(Generic[T]):
    def __init__(self, maxsize: int, batch_size: int) -> None:
        if maxsize < 1 or batch_size < 1:
            raise ValueError("maxsize and batch_size must be at least 1")
        self.maxsize = maxsize
        self.batch_size = batch_size
        self.ready = threading.Event()  # set when a batch is full or someone is waiting on the rows
        self._items: collections.deque[T] = collections.deque()
        # Each counter has one writer thread of its own, so neither needs a lock.
        self._put = 0  # by the event loop
        self._done = 0  # by the writer thread

    def put_nowait(self, item: T) -> None:
        if len(self._items) >= self.maxsize:
            raise InboxFull()
        self._items.append(item)
        self._put += 1
        if len(self._items) >= self.batch_size:
            self.ready.set()

    def wake(self) -> None:
        self.ready.set()

    def wait(self, timeout: float) -> None:
        """Until a batch is full or `wake()` is called, at most `timeout` seconds (writer thread)."""
        if len(self._items) < self.batch_size:
            self.ready.wait(timeout)
        self.ready.clear()

    def take(self, n: int) -> list[T]:
        """Up to `n` items, oldest first, without waiting (writer thread)."""
        out: list[T] = []
        items = self._items
        while items and len(out) < n:
            out.append(items.popleft())
        return out

    def done(self, n: int = 1) -> None:
        """`n` taken items are written (or spooled): `unfinished` counts them no more."""
        self._done += n

    @property
    def unfinished(self) -> int:
        return self._put - self._done

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items
