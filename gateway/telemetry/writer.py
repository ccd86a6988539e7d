"""The background writer: request path -> bounded queue -> batched idempotent inserts.

`submit()` never touches the database or the disk: it runs on the event loop. A thread takes rows
off the queue in batches (by size or after `flush_interval`), fits their values to the columns and
inserts them with ON CONFLICT DO NOTHING on the request id, so a replayed or repeated row can never
become a duplicate, whichever replica wrote it first. Rows that find the queue full wait in an
overflow list that the thread moves to the spool first.

When an insert fails, the writer asks the database whether it is there at all:
- unreachable: the batch goes to this process's spool file; every `retry_interval` the writer
  replays the spool and, once it is all in, empties it. New batches queue behind the spool.
- reachable: the batch itself is at fault. Its rows are inserted one by one and any row the
  database refuses is quarantined (the `telemetry_quarantine` table, or a file beside the spool if
  even that fails) with its error, so one bad row never blocks the rows behind it, here or in a
  replay, across restarts too.
Spool files left by processes that are gone are adopted and replayed (see `spool.py`).
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from specgate.gateway.telemetry.db_faults import row_fault, transient
from specgate.gateway.telemetry.fit import fit_row
from specgate.gateway.telemetry.idle_cpu import yield_cpu
from specgate.gateway.telemetry.inbox import Inbox, InboxFull
from specgate.gateway.telemetry.quarantine import keep_refused
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.rows import Entry, entry_of, to_sql, upgrade_row
from specgate.gateway.telemetry.spool import Orphan, Spool
from specgate.gateway.telemetry.tables import requests, spec_steps

logger = logging.getLogger("specgate.telemetry")
ORPHAN_SCAN_INTERVAL = 10.0


class DatabaseDown(Exception):
    """An insert failed for a reason that is not the rows' (the database is unreachable, locked or
    timing out): spool and retry, don't quarantine."""


# A batch that lost a lock (db_faults.transient) is tried again after a pause before its rows go to
# the spool and the database is reported down.
TRANSIENT_RETRIES = 3
TRANSIENT_PAUSE = 0.05  # seconds, doubled on each retry


@dataclass(slots=True)
class WriterCounters:
    queued: int = 0
    written: int = 0
    spooled: int = 0
    replayed: int = 0
    dropped: int = 0
    db_errors: int = 0
    quarantined: int = 0
    adopted: int = 0  # spool files of dead processes replayed here
    spool_backlog: int = 0  # rows in this process's spool now


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
        self._queue: Inbox[dict[str, Any]] = Inbox(max_queue, batch_size)
        self._overflow: collections.deque[dict[str, Any]] = collections.deque()
        self._stop = threading.Event()
        self._last_retry = 0.0
        self._last_scan = 0.0
        self._thread = threading.Thread(target=self._run, name="specgate-telemetry", daemon=True)
        self._rng = random.Random()
        self._insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert

    # ---- request path (event loop: no I/O here) -----------------------------------------------

    def submit(self, rec: RequestRecord) -> None:
        self.submit_entry(entry_of(rec, self.step_sample_rate, self._rng))

    def submit_entry(self, entry: Entry) -> None:
        """A record's rows as they came from a worker's relay (rows.py), already sampled."""
        self.counters.queued += 1
        try:
            self._queue.put_nowait(entry)
        except InboxFull:  # the writer is far behind: its thread moves these to the spool
            self._overflow.append(entry)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def yield_cpu(self) -> None:
        """Run the writer thread only on CPU nothing else wants (idle_cpu.py). Only where no request
        waits on its GIL (the supervisor of `serve`): its batch inserts then give way to the
        processes that serve requests on the same cores instead of delaying them by a scheduler
        slice (measured: a cluster of 4-10 ms requests every flush)."""
        if self._thread.native_id is not None:
            yield_cpu(self._thread.native_id, "telemetry writer")

    def close(self, timeout: float = 30.0) -> None:
        """Flush everything (to the database, or the spool if it is down) and stop."""
        self._stop.set()
        self._queue.wake()  # don't sit out the rest of a flush interval
        self._thread.join(timeout)
        self.spool.close()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every submitted row has been written or spooled (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished or self._overflow:
            if time.monotonic() > deadline:
                return False
            self._queue.wake()  # someone waits on these rows: write them now
            time.sleep(0.005)
        return True

    def queue_size(self) -> int:
        return self._queue.qsize() + len(self._overflow)

    def backlog(self) -> int:
        """Rows not yet in the database: queued, overflowing, or in this process's spool."""
        return self.queue_size() + self.counters.spool_backlog

    def ping(self) -> bool:
        return ping(self.engine)

    # ---- writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._cycle()
            except Exception:  # never let the thread die: rows would pile up unseen
                logger.exception("telemetry writer cycle failed")
                time.sleep(self.retry_interval)
            if self._stop.is_set() and self._queue.empty() and not self._overflow:
                self._spill_overflow()
                return

    def _cycle(self) -> None:
        self._spill_overflow()
        batch = self._take()
        if batch:
            try:
                self._write(batch)
            finally:
                self._queue.done(len(batch))
        elif self.counters.spool_backlog:
            self._maybe_replay()
        if time.monotonic() - self._last_scan >= ORPHAN_SCAN_INTERVAL:
            self._last_scan = time.monotonic()
            self._adopt_orphans()

    def _spill_overflow(self) -> None:
        if not self._overflow:
            return
        entries = []
        while self._overflow:
            entries.append(self._overflow.popleft())
        self._to_spool(entries)

    def _take(self) -> list[dict[str, Any]]:
        if not self._stop.is_set():
            self._queue.wait(self.flush_interval)
        return self._queue.take(self.batch_size)

    def _write(self, batch: list[dict[str, Any]]) -> None:
        if self.counters.spool_backlog and not self._maybe_replay():
            self._to_spool(batch)  # the database is still down: queue behind the spool
            return
        try:
            self._insert_resilient(batch)
        except DatabaseDown:
            self._to_spool(batch)
            return
        self.counters.written += len(batch)

    def _maybe_replay(self) -> bool:
        if time.monotonic() - self._last_retry < self.retry_interval and not self._stop.is_set():
            return False
        return self._replay()

    def _replay(self) -> bool:
        self._last_retry = time.monotonic()
        try:
            n = self._insert_chunks(self.spool.read())
        except DatabaseDown:
            return False
        self.spool.clear()
        self.counters.spool_backlog = 0
        self.counters.replayed += n
        if n:
            logger.warning("telemetry database is back: replayed %d spooled rows", n)
        return True

    def _adopt_orphans(self) -> None:
        """Replay spool files whose process is gone (a crash, a replica that stopped)."""
        try:
            orphans = list(self.spool.orphans())
        except OSError:
            return
        for orphan in orphans:
            try:
                self._adopt(orphan)
            except DatabaseDown:
                return
            except Exception:
                logger.exception("replaying the orphaned spool %s failed", orphan.path)

    def _adopt(self, orphan: Orphan) -> None:
        try:
            n = self._insert_chunks(orphan.read())
        except BaseException:
            orphan.release()  # the lock goes with it: the next scan (here or elsewhere) tries again
            raise
        orphan.done()
        self.counters.adopted += 1
        self.counters.replayed += n
        logger.warning("replayed %d telemetry rows left in %s by a process that is gone", n, orphan.path)

    def _insert_chunks(self, entries: Iterable[dict[str, Any]]) -> int:
        n = 0
        chunk: list[dict[str, Any]] = []
        for entry in entries:
            chunk.append(entry)
            if len(chunk) >= self.batch_size:
                self._insert_resilient(chunk)
                n += len(chunk)
                chunk = []
        if chunk:
            self._insert_resilient(chunk)
            n += len(chunk)
        return n

    def _insert_resilient(self, entries: list[dict[str, Any]]) -> None:
        """Insert `entries`; raises DatabaseDown if the database cannot take rows now (unreachable,
        locked, timing out: spool and retry). Rows it refuses for a reason of their own are found by
        halving the batch and quarantined, the rest inserted."""
        for attempt in range(TRANSIENT_RETRIES + 1):
            try:
                self._insert_entries(entries)
            except Exception as exc:
                if attempt < TRANSIENT_RETRIES and transient(exc):
                    logger.debug("telemetry insert lost a lock (%s); trying again", exc)
                    time.sleep(TRANSIENT_PAUSE * 2**attempt)
                    continue
                self.counters.db_errors += 1
                self._raise_if_down(exc)
                self._bisect(entries, exc)
            break
        self.db_up = True

    def _bisect(self, entries: list[dict[str, Any]], exc: Exception) -> None:
        if len(entries) == 1:
            self._quarantine(entries[0], exc)
            return
        mid = len(entries) // 2
        for half in (entries[:mid], entries[mid:]):
            try:
                self._insert_entries(half)
            except Exception as half_exc:
                self._raise_if_down(half_exc)
                self._bisect(half, half_exc)

    def _raise_if_down(self, exc: Exception) -> None:
        if not row_fault(exc) or not self.ping():
            self.note_db_failure(exc)
            raise DatabaseDown() from exc

    def _insert_entries(self, entries: list[dict[str, Any]]) -> None:
        rows = [to_sql(fit_row(requests, upgrade_row(e["r"]))) for e in entries]
        steps = [fit_row(spec_steps, s) for e in entries for s in e.get("s", ())]
        with self.engine.begin() as conn:
            conn.execute(self._insert(requests).on_conflict_do_nothing(index_elements=["request_id"]), rows)
            if steps:
                stmt = self._insert(spec_steps).on_conflict_do_nothing(
                    index_elements=["request_id", "step_index"]
                )
                conn.execute(stmt, steps)

    def _quarantine(self, entry: dict[str, Any], exc: Exception) -> None:
        if keep_refused(self.engine, self.spool.directory, entry, exc):
            self.counters.quarantined += 1
        else:
            self.counters.dropped += 1

    def _to_spool(self, entries: list[dict[str, Any]]) -> None:
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
        self.counters.spool_backlog += len(entries)

    def note_db_failure(self, exc: Exception) -> None:
        if self.db_up:
            logger.error("telemetry database unavailable, spooling to %s: %s", self.spool.path, exc)
        self.db_up = False


def ping(engine: Engine) -> bool:
    """Whether the database answers a trivial query now."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
