"""The telemetry writer's inbox: rows from the event loop to the writer thread, without a wake-up each.

A `queue.Queue` notifies its consumer on every put: one thread switch (and a GIL hand-over) per
request on the event loop's critical path, measured at an eighth of the gateway's CPU per request
when requests come one at a time. Here a put is a deque append; the writer wakes for a full batch,
for `close`/`flush`, or at its flush interval, whichever comes first.
"""

from __future__ import annotations

import collections
import threading
from typing import Any


class InboxFull(Exception):
    pass


class Inbox:
    def __init__(self, maxsize: int, batch_size: int) -> None:
        if maxsize < 1 or batch_size < 1:
            raise ValueError("maxsize and batch_size must be at least 1")
        self.maxsize = maxsize
        self.batch_size = batch_size
        self.ready = threading.Event()  # set when a batch is full or someone is waiting on the rows
        self._items: collections.deque[dict[str, Any]] = collections.deque()
        # Each counter has one writer thread of its own, so neither needs a lock.
        self._put = 0  # by the event loop
        self._done = 0  # by the writer thread

    def put_nowait(self, item: dict[str, Any]) -> None:
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

    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` items, oldest first, without waiting (writer thread)."""
        out: list[dict[str, Any]] = []
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
