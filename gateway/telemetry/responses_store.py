"""Stored Responses API responses in the telemetry database (`tables.responses`).

Writes are behind the answer, as telemetry rows are: `put` queues a response and returns at once,
and one writer thread per process inserts whatever has queued meanwhile in one transaction (an
insert and a commit per answer cost a third of a gateway's per-request CPU). Until its row is
written, this process reads a response from its queue, so a client's next request with
`previous_response_id` finds it; a row the database refuses stays queued and is retried, and
while the queue is full (`MAX_QUEUED`, a database down for long) new responses are refused up
front (`backlogged`). Reads and deletes block (SQL): the HTTP layer runs them in a thread
(`asyncio.to_thread`), never on the event loop. Ownership is part of every query: a response is
found only with its owner, so another key's id reads as one that does not exist.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from specgate.gateway.telemetry.tables import responses as table

logger = logging.getLogger(__name__)
MAX_QUEUED = 10_000  # responses not yet written: beyond, new ones are refused until the database is back
RETRY_SECONDS = (0.1, 0.5, 2.0, 5.0)  # waits between tries of a batch the database refused
# The writer waits this long after a response is queued before writing: the answer goes out first
# (the insert would hold the GIL while the event loop sends it) and answers close together share a
# transaction.
GATHER_SECONDS = 0.02


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_id: str
    owner: str
    created_at: float
    model: str
    status: str
    previous_response_id: str | None
    input_tokens: int | None
    output_tokens: int | None
    input_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    response: dict[str, Any]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its input, then its output."""
        return [*self.input_items, *self.output_items]


def _values(row: StoredResponse) -> dict[str, Any]:
    return {f.name: getattr(row, f.name) for f in fields(StoredResponse)}


class ResponseStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._queued: dict[str, StoredResponse] = {}  # not yet written (or being written), by id
        self._batch: list[StoredResponse] = []  # to write next
        self._closed = False
        self._writer: threading.Thread | None = None

    # ---- writing ----------------------------------------------------------------------------------

    def save(self, row: StoredResponse) -> None:
        """Insert one response now (blocking)."""
        with self.engine.begin() as conn:
            conn.execute(insert(table).values(**_values(row)))

    @property
    def backlogged(self) -> bool:
        """Whether the queue is full: the database has refused or kept out the last MAX_QUEUED."""
        return len(self._queued) >= MAX_QUEUED

    def put(self, row: StoredResponse) -> None:
        """Queue a response for the writer thread; readable in this process at once."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the response store is closed")
            if len(self._queued) >= MAX_QUEUED:
                raise RuntimeError("the response store's queue is full")
            self._queued[row.response_id] = row
            self._batch.append(row)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="responses-writer", daemon=True)
                self._writer.start()
            self._cond.notify()

    def _write(self) -> None:
        tries = 0
        while True:
            with self._cond:
                while not self._batch and not self._closed:
                    self._cond.wait()
                if not self._batch:
                    return
                if not self._closed:
                    self._cond.wait(GATHER_SECONDS)
                batch, self._batch = self._batch, []
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(table), [_values(r) for r in batch])
            except Exception:
                wait = RETRY_SECONDS[min(tries, len(RETRY_SECONDS) - 1)]
                logger.exception("stored responses: writing %d failed; retrying in %.1f s", len(batch), wait)
                tries += 1
                with self._cond:
                    self._batch[:0] = batch
                    if self._closed and tries > len(RETRY_SECONDS):
                        logger.error("stored responses: %d not written at shutdown", len(self._batch))
                        return
                    self._cond.wait(wait)
                continue
            tries = 0
            with self._cond:
                for r in batch:
                    if self._queued.get(r.response_id) is r:
                        del self._queued[r.response_id]
                self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued response is written; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        """Write what is queued (retrying a while), then stop the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(30)

    # ---- reading ----------------------------------------------------------------------------------

    def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._cond:
            queued = self._queued.get(response_id)
        if queued is not None:
            return queued if queued.owner == owner else None
        query = select(table).where(table.c.response_id == response_id, table.c.owner == owner)
        with self.engine.connect() as conn:
            found = conn.execute(query).mappings().first()
        if found is None:
            return None
        return StoredResponse(**{f.name: found[f.name] for f in fields(StoredResponse)})

    def delete(self, response_id: str, owner: str) -> bool:
        with self._cond:
            queued = self._queued.get(response_id)
            if queued is not None and queued.owner == owner and queued in self._batch:
                self._batch.remove(queued)  # never written: nothing to delete in the database
                del self._queued[response_id]
                return True
            # Being written now: wait for it, so the delete below cannot run before the insert.
            self._cond.wait_for(lambda: response_id not in self._queued, 10.0)
        query = delete(table).where(table.c.response_id == response_id, table.c.owner == owner)
        with self.engine.begin() as conn:
            return bool(conn.execute(query).rowcount)
