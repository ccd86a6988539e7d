"""The telemetry store as the gateway uses it: built from settings, schema checked, writer running."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from specgate.gateway.settings import TelemetrySettings
from specgate.gateway.telemetry.records import RequestRecord
from specgate.gateway.telemetry.schema import (
    SchemaOutdatedError,
    default_data_dir,
    default_url,
    ensure_schema,
    make_engine,
)
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter


class TelemetryStore:
    def __init__(self, settings: TelemetrySettings) -> None:
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
        try:
            ensure_schema(self.engine, self.url, self.auto_upgrade)
        except SchemaOutdatedError:
            raise
        except Exception as exc:  # unreachable: fine for a remote database, fatal for our own file
            if self.auto_upgrade:
                raise
            self.writer.note_db_failure(exc)
        self.writer.start()

    def submit(self, record: RequestRecord) -> None:
        self.writer.submit(record)

    async def ready(self) -> tuple[bool, str]:
        ok = await asyncio.to_thread(self.writer.ping)
        w = self.writer
        state = "reachable" if ok else f"unreachable; spooling to {w.spool.path}"
        return ok, f"{state}; backlog {w.backlog()} rows, quarantined {w.counters.quarantined}"

    def close(self) -> None:
        self.writer.close()
        self.engine.dispose()
