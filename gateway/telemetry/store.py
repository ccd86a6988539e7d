"""The telemetry store as the gateway uses it: built from settings, schema checked, writer running.

With `relay` (a worker of `specgate serve --workers N`: the supervisor's relay socket) the store
starts no writer: records go to a RelaySink and the supervisor's one writer inserts them; the
store's engine is still there for reading (the admin API, the dashboard, the policy's versions) and
for the readiness check. The supervisor has checked (or upgraded) the schema before starting the
workers; a worker only checks it, never upgrades it (N processes must not race to migrate).
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from specgate.gateway.settings import TelemetrySettings
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.relay_sink import RelaySink
from specgate.gateway.telemetry.rows import Entry
from specgate.gateway.telemetry.schema import (
    SchemaOutdatedError,
    default_data_dir,
    default_url,
    ensure_schema,
    make_engine,
)
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter, WriterCounters, ping


class TelemetryStore:
    def __init__(self, settings: TelemetrySettings, relay: str | None = None) -> None:
        self.settings = settings
        self.url = settings.url.get_secret_value() if settings.url else default_url()
        self.auto_upgrade = (
            settings.auto_upgrade if settings.auto_upgrade is not None else settings.url is None
        )
        # One directory per database; in it, one spool file per process (see spool.py).
        spool = settings.spool_dir or str(default_data_dir() / f"telemetry-spool-{self._url_tag()}")
        legacy = default_data_dir() / f"telemetry-spool-{self._url_tag()}.jsonl"  # before 0.2
        self.engine = make_engine(
            self.url, connect_timeout=settings.connect_timeout, statement_timeout=settings.statement_timeout
        )
        self.relay: RelaySink | None = None
        self.writer: TelemetryWriter | None = None
        if relay is not None:
            self.relay = RelaySink(
                relay,
                batch_size=settings.batch_size,
                flush_interval=settings.flush_interval,
                max_backlog=settings.max_queue,
                step_sample_rate=settings.spec_steps_sample_rate,
            )
        else:
            self.writer = TelemetryWriter(
                self.engine,
                Spool(Path(spool), legacy),
                batch_size=settings.batch_size,
                flush_interval=settings.flush_interval,
                max_queue=settings.max_queue,
                retry_interval=settings.retry_interval,
                step_sample_rate=settings.spec_steps_sample_rate,
            )

    def _url_tag(self) -> str:
        return hashlib.sha256(self.url.encode()).hexdigest()[:10]

    def open(self) -> None:
        """Check (or, for the embedded default, upgrade) the schema, then start writing.

        A database that is down at start is not fatal: rows spool until it is back. An outdated
        schema is: SchemaOutdatedError names the command to run.
        """
        upgrade = self.auto_upgrade and self.writer is not None
        try:
            ensure_schema(self.engine, self.url, upgrade)
        except SchemaOutdatedError:
            raise
        except Exception as exc:  # unreachable: fine for a remote database, fatal for our own file
            if upgrade:
                raise
            if self.writer is not None:
                self.writer.note_db_failure(exc)
        if self.writer is not None:
            self.writer.start()
        if self.relay is not None:
            self.relay.start()

    def submit(self, record: RequestRecord) -> None:
        if self.writer is not None:
            self.writer.submit(record)
        elif self.relay is not None:
            self.relay.submit(record)

    def submit_entry(self, entry: Entry) -> None:
        """A worker's record as its relay sent it (the supervisor's relay server calls this)."""
        if self.writer is None:
            raise RuntimeError("only a store with a writer takes relayed entries")
        self.writer.submit_entry(entry)

    @property
    def counters(self) -> WriterCounters:
        """The writer's counters, or in a worker the relay's (the same fields; see relay_sink.py)."""
        return self.writer.counters if self.writer is not None else self._relay().counters

    def queue_size(self) -> int:
        return self.writer.queue_size() if self.writer is not None else self._relay().queue_size()

    def _relay(self) -> RelaySink:
        assert self.relay is not None
        return self.relay

    async def ready(self) -> tuple[bool, str]:
        ok = await asyncio.to_thread(ping, self.engine)
        w = self.writer
        if w is None:
            c = self._relay().counters
            state = "reachable" if ok else "unreachable"
            return ok, f"{state}; relay backlog {self.queue_size()} rows, dropped {c.dropped}"
        state = "reachable" if ok else f"unreachable; spooling to {w.spool.path}"
        return ok, f"{state}; backlog {w.backlog()} rows, quarantined {w.counters.quarantined}"

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.relay is not None:
            self.relay.close()
        self.engine.dispose()
