"""Where a row the database refuses goes: the `telemetry_quarantine` table, with the error and the
row as JSON, so an operator can see it, fix the cause and replay it; if even that table refuses it
(or the database went away meanwhile), a `quarantine-<pid>.jsonl` file beside the spool. Only when
neither can be written is the row lost, and that is logged as critical and counted."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from specgate.gateway.telemetry.fit import clean_text
from specgate.gateway.telemetry.spool import write_all
from specgate.gateway.telemetry.tables import telemetry_quarantine

logger = logging.getLogger("specgate.telemetry")


def keep_refused(engine: Engine, directory: Path, entry: dict[str, Any], exc: Exception) -> bool:
    """Quarantine one refused spool entry ({"r": row, "s": steps}); False if it could not be kept."""
    row = entry.get("r") or {}
    request_id = clean_text(str(row.get("request_id")), 128)
    error = clean_text(f"{type(exc).__name__}: {exc}", 4000)
    payload = json.dumps(entry, ensure_ascii=True, default=str)
    logger.error("telemetry row %s quarantined: %s", request_id, error.splitlines()[0][:200])
    try:
        with engine.begin() as conn:
            conn.execute(
                telemetry_quarantine.insert(),
                {
                    "quarantined_at": dt.datetime.now(dt.UTC),
                    "request_id": request_id,
                    "error": error,
                    "row": payload,
                },
            )
        return True
    except Exception:
        logger.exception("the quarantine table refused row %s too; keeping it in a file", request_id)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            directory / f"quarantine-{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600
        )
        try:
            write_all(fd, (json.dumps({"error": error, "entry": payload}, ensure_ascii=True) + "\n").encode())
        finally:
            os.close(fd)
        return True
    except OSError:
        logger.critical("TELEMETRY ROW LOST: %s could not be quarantined anywhere", request_id)
        return False
