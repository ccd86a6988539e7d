"""A worker's end of the telemetry relay (relay.py): a RecordSink that sends to the supervisor.

`submit` runs on the event loop, after the request's answer is out: it turns the record into its
entry (rows.py: plain data) and encodes it as one line of JSON, and appends the bytes to a bounded
`Inbox` (inbox.py); it never blocks and never raises. A thread takes up to `batch_size` encoded
entries at a time, frames them and sends the batch, then waits for the server's acknowledgement;
only then is the batch gone from here. The thread runs no per-record Python: encoding a flush's
worth of records there (a few ms at a thousand requests a second) would
hold the GIL while the event loop waits, and set the gateway's sequential p99. A broken
connection is opened again with backoff (up to `max_backoff` seconds) and the unacknowledged batch
sent again; meanwhile records wait in the inbox, and once it holds `max_backlog` the new ones are
dropped and counted (`counters.dropped`, on /metrics as specgate_telemetry_rows_dropped: it must
stay 0). `close()` flushes: it returns once everything was acknowledged or `close_timeout` passed.

The counters are the writer's (`WriterCounters`), so /metrics shows a worker's relay where a
single-process gateway shows its writer: queued (handed to the relay), written (acknowledged by the
supervisor, whose writer then owns them), dropped, db_errors (failed sends).
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import threading
import time

from specgate.gateway.telemetry.inbox import Inbox
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.relay import ACK, encode_frame
from specgate.gateway.telemetry.rows import encode_entry, entry_of
from specgate.gateway.telemetry.writer import WriterCounters

logger = logging.getLogger("specgate.telemetry")


class RelaySink:
    def __init__(
        self,
        socket_path: str,
        *,
        batch_size: int = 256,
        flush_interval: float = 0.05,
        max_backlog: int = 100_000,
        max_backoff: float = 2.0,
        io_timeout: float = 30.0,
        close_timeout: float = 30.0,
        step_sample_rate: float = 0.0,
    ) -> None:
        if batch_size < 1 or flush_interval <= 0 or max_backlog < 1 or max_backoff <= 0 or io_timeout <= 0:
            raise ValueError("invalid telemetry relay settings")
        if not 0.0 <= step_sample_rate <= 1.0:
            raise ValueError("invalid telemetry relay settings")
        self.step_sample_rate = step_sample_rate  # sampled here: unsampled steps never cross
        self.path = socket_path
        self.batch_size = batch_size
        self.flush_interval = flush_interval
        self.max_backoff = max_backoff
        self.io_timeout = io_timeout
        self.close_timeout = close_timeout
        self.counters = WriterCounters()
        self._rng = random.Random()
        # Encoded entries; the thread is woken per batch.
        self._backlog: Inbox[bytes] = Inbox(max_backlog, batch_size)
        self._pending: tuple[bytes, int] | None = None  # the frame sent and not yet acknowledged
        self._conn: socket.socket | None = None
        self._stop = threading.Event()
        self._deadline = float("inf")  # set by close(): give up sending then
        self._thread = threading.Thread(target=self._run, name="specgate-telemetry-relay", daemon=True)

    # ---- event loop ---------------------------------------------------------------------------

    def submit(self, record: RequestRecord) -> None:
        try:
            data = encode_entry(entry_of(record, self.step_sample_rate, self._rng))
        except Exception:
            self.counters.dropped += 1
            logger.exception("telemetry relay: request %s cannot be encoded", record.request_id)
            return
        try:
            self._backlog.put_nowait(data)
            self.counters.queued += 1
        except Exception:  # full (InboxFull), or anything else: a sink never fails the request
            self.counters.dropped += 1

    def queue_size(self) -> int:
        return self._backlog.qsize() + (self._pending[1] if self._pending else 0)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> RelaySink:
        self._thread.start()
        return self

    def close(self) -> None:
        """Send everything submitted so far (or give up after `close_timeout`), then disconnect."""
        self._deadline = time.monotonic() + self.close_timeout
        self._stop.set()
        self._backlog.wake()
        if self._thread.is_alive():
            self._thread.join(self.close_timeout + self.io_timeout)
        lost = self.queue_size()
        if lost:
            self.counters.dropped += lost
            logger.error("telemetry relay: %d records were not delivered before shutdown", lost)
        self._disconnect()

    # ---- sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        while True:
            if backoff:
                time.sleep(backoff)  # not cut short by close(): it waits for the retries
            elif self._backlog.empty() and self._pending is None:
                if self._stop.is_set():
                    return
                self._backlog.wait(self.flush_interval)
            if time.monotonic() > self._deadline:
                return
            try:
                while self._send_one():
                    pass
                backoff = 0.0
            except OSError as exc:
                self.counters.db_errors += 1
                self._disconnect()
                backoff = min(self.max_backoff, max(0.05, backoff * 2)) * random.uniform(0.8, 1.2)
                logger.warning("telemetry relay %s: %r; retrying in %.2fs", self.path, exc, backoff)
            except Exception:  # never let the thread die: records would pile up unseen
                logger.exception("telemetry relay failed")
                backoff = self.max_backoff

    def _send_one(self) -> bool:
        """Send the pending batch, or the next one; False when there is nothing to send."""
        if self._pending is None:
            self._pending = self._next_frame()
            if self._pending is None:
                return False
        if self._conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self.io_timeout)
            try:
                conn.connect(self.path)
            except OSError:
                conn.close()
                raise
            self._conn = conn
        frame, n = self._pending
        self._conn.sendall(frame)
        if self._conn.recv(1) != ACK:
            raise ConnectionError("the relay closed the connection before acknowledging a batch")
        self._pending = None
        self.counters.written += n
        return True

    def _next_frame(self) -> tuple[bytes, int] | None:
        items = self._backlog.take(self.batch_size)
        return (encode_frame(items), len(items)) if items else None

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
