"""A refused row is kept: in the quarantine table, else in a file beside the spool, else counted lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sqlalchemy import select

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.quarantine import keep_refused
from specgate.gateway.telemetry.tables import telemetry_quarantine

ENTRY = {"r": {"request_id": "req-\ud800-1\x00", "outcome": None}, "s": [{"step_index": 0}]}


def test_the_row_goes_to_the_quarantine_table_with_its_error(sqlite_url: str, tmp_path: Path) -> None:
    schema.upgrade(sqlite_url)
    engine = schema.make_engine(sqlite_url)
    directory = tmp_path / "spool"
    assert keep_refused(engine, directory, ENTRY, ValueError("NOT NULL constraint failed: requests.outcome"))
    with engine.connect() as conn:
        row = conn.execute(select(telemetry_quarantine)).mappings().one()
    engine.dispose()
    assert row["request_id"] == "req-?-1"  # a lone surrogate and a NUL cannot be stored as text
    assert row["error"] == "ValueError: NOT NULL constraint failed: requests.outcome"
    assert json.loads(row["row"])["s"] == [{"step_index": 0}]
    assert not directory.exists()  # no file needed


def test_without_the_table_the_row_goes_to_a_file(sqlite_url: str, tmp_path: Path) -> None:
    engine = schema.make_engine(sqlite_url)  # no schema: the quarantine table is missing too
    directory = tmp_path / "spool"
    assert keep_refused(engine, directory, ENTRY, ValueError("refused"))
    engine.dispose()
    [line] = (directory / f"quarantine-{os.getpid()}.jsonl").read_text().splitlines()
    kept = json.loads(line)
    assert kept["error"] == "ValueError: refused" and json.loads(kept["entry"])["r"]["outcome"] is None


def test_with_nowhere_to_keep_it_the_row_is_reported_lost(sqlite_url: str, tmp_path: Path) -> None:
    engine = schema.make_engine(sqlite_url)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    assert not keep_refused(engine, blocked / "spool", ENTRY, ValueError("refused"))
    engine.dispose()
