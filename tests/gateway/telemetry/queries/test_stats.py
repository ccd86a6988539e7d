"""window_stats (GET /admin/stats) on SQLite and PostgreSQL: the prefix-cache share of prompt tokens."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.queries.stats import window_stats
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter
from tests.gateway.telemetry.test_writer import record


def test_cached_token_share_counts_only_rows_that_report_hits(db_url: str, tmp_path: Path) -> None:
    schema.upgrade(db_url)
    engine = schema.make_engine(db_url)
    w = TelemetryWriter(engine, Spool(tmp_path / "s.jsonl"), flush_interval=0.02)
    w.start()
    for i in range(6):
        # 10 prompt tokens, 4 of them cached; the last two from a backend that does not say
        w.submit(record(i, backend="upstream", cached_tokens=None) if i >= 4 else record(i))
    assert w.flush()
    w.close()
    stats = window_stats(engine, dt.datetime.now(dt.UTC) - dt.timedelta(hours=1))
    engine.dispose()
    totals = stats["totals"]
    assert totals["prompt_tokens"] == 60 and totals["cached_tokens"] == 16
    assert totals["cached_token_share"] == 0.4  # 16 of the 40 prompt tokens of reporting rows
    by_backend = {r["backend"]: r["cached_token_share"] for r in stats["route_performance"]}
    assert by_backend == {"embedded": 0.4, "upstream": None}
