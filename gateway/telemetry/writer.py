"""The background writer: request path -> bounded queue -> batched idempotent inserts.

`submit()` never touches the database. A thread takes rows off the queue in batches (by size or
after `flush_interval`) and inserts them with ON CONFLICT DO NOTHING on the request id, so a
replayed or repeated row can never become a duplicate, whichever replica wrote it first. When the
database fails, batches go to the spool file instead; every `retry_interval` the writer replays the
spool in order and, once it is all in, deletes it. New batches queue behind the spool meanwhile,
so rows reach the database in the order they were written.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from gateway.records import RequestRecord
from gateway.telemetry.rows import request_row, step_rows, to_sql
from gateway.telemetry.spool import Spool
from gateway.telemetry.tables import requests, spec_steps

logger = logging.getLogger("specgate.telemetry")
_WAKE: dict[str, Any] = {}  # put on the queue by close() to wake the thread; never written


@dataclass(slots=True)
class WriterCounters:
    queued: int = 0
    written: int = 0
    spooled: int = 0
    replayed: int = 0
    dropped: int = 0
    db_errors: int = 0


class TelemetryWriter:
    def __init__(
        self,
        engine: Engine,
        spool: Spool,
        *,
        batch_size: int = 256,
        flush_interval: float = 0.2,
        max_queue: int = 100_000,
        retry_interval: float = 1.0,
        step_sample_rate: float = 0.0,
    ) -> None:
        if batch_size < 1 or flush_interval <= 0 or max_queue < 1 or not 0.0 <= step_sample_rate <= 1.0:
            raise ValueError("invalid telemetry writer settings")
        self.engine = engine
        self.spool = spool
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.retry_interval = retry_interval
        self.step_sample_rate = step_sample_rate
        self.counters = WriterCounters()
        self.db_up = True
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=max_queue)
        self._spool_lock = threading.Lock()
        self._stop = threading.Event()
        self._last_retry = 0.0
        self._thread = threading.Thread(target=self._run, name="specgate-telemetry", daemon=True)
        self._rng = random.Random()
        self._insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert

    # ---- request path -------------------------------------------------------------------------

    def submit(self, rec: RequestRecord) -> None:
        entry: dict[str, Any] = {"r": request_row(rec)}
        if rec.spec_steps and self.step_sample_rate and self._rng.random() < self.step_sample_rate:
            entry["s"] = step_rows(rec)
        self.counters.queued += 1
        try:
            self._queue.put_nowait(entry)
        except queue.Full:  # the writer is far behind: keep the row on disk rather than lose it
            self._to_spool([entry])

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Flush everything (to the database, or the spool if it is down) and stop."""
        self._stop.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_WAKE)  # don't sit out the rest of a flush interval
        self._thread.join(timeout)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted row has been written or spooled (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def queue_size(self) -> int:
        return self._queue.qsize()

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    # ---- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        if not self.spool.empty():
            self._replay()
        while True:
            batch = self._take()
            if batch:
                self._write(batch)
                for _ in batch:
                    self._queue.task_done()
            elif not self.spool.empty():
                self._maybe_replay()
            if self._stop.is_set() and self._queue.empty():
                return

    def _take(self) -> list[dict[str, Any]]:
        batch: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.flush_interval
        while len(batch) < self.batch_size:
            remaining = deadline - time.monotonic()
            try:
                if self._stop.is_set() or remaining <= 0:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if item is _WAKE:
                self._queue.task_done()
                continue
            batch.append(item)
        return batch

    def _write(self, batch: list[dict[str, Any]]) -> None:
        if not self.spool.empty() and not self._maybe_replay():
            self._to_spool(batch)  # keep order: older rows are still in the spool
            return
        try:
            self._insert_entries(batch)
        except Exception as exc:
            self.note_db_failure(exc)
            self._to_spool(batch)
            return
        self.counters.written += len(batch)
        self._db_ok()

    def _maybe_replay(self) -> bool:
        if time.monotonic() - self._last_retry < self.retry_interval and not self._stop.is_set():
            return False
        return self._replay()

    def _replay(self) -> bool:
        self._last_retry = time.monotonic()
        with self._spool_lock:
            try:
                n = 0
                chunk: list[dict[str, Any]] = []
                for entry in self.spool.read():
                    chunk.append(entry)
                    if len(chunk) >= self.batch_size:
                        self._insert_entries(chunk)
                        n += len(chunk)
                        chunk = []
                if chunk:
                    self._insert_entries(chunk)
                    n += len(chunk)
            except Exception as exc:
                self.note_db_failure(exc)
                return False
            self.spool.clear()
        self.counters.replayed += n
        if n:
            logger.warning("telemetry database is back: replayed %d spooled rows", n)
        self._db_ok()
        return True

    def _insert_entries(self, entries: Iterable[dict[str, Any]]) -> None:
        entries = list(entries)
        rows = [to_sql(e["r"]) for e in entries]
        steps = [s for e in entries for s in e.get("s", ())]
        with self.engine.begin() as conn:
            conn.execute(self._insert(requests).on_conflict_do_nothing(index_elements=["request_id"]), rows)
            if steps:
                stmt = self._insert(spec_steps).on_conflict_do_nothing(
                    index_elements=["request_id", "step_index"]
                )
                conn.execute(stmt, steps)

    def _to_spool(self, entries: list[dict[str, Any]]) -> None:
        with self._spool_lock:
            try:
                self.spool.append(entries)
            except OSError:
                self.counters.dropped += len(entries)
                logger.critical(
                    "TELEMETRY ROWS LOST: %d rows could not be written to the database or the spool %s",
                    len(entries),
                    self.spool.path,
                    exc_info=True,
                )
                return
        self.counters.spooled += len(entries)

    def note_db_failure(self, exc: Exception) -> None:
        self.counters.db_errors += 1
        if self.db_up:
            logger.error("telemetry database unavailable, spooling to %s: %s", self.spool.path, exc)
        self.db_up = False

    def _db_ok(self) -> None:
        self.db_up = True
