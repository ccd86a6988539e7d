"""The SQL questions in docs/telemetry.md run on SQLite and PostgreSQL and give sensible answers."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from specgate.gateway.telemetry import schema
from specgate.gateway.telemetry.spool import Spool
from specgate.gateway.telemetry.writer import TelemetryWriter
from tests.gateway.telemetry.test_writer import record

TELEMETRY_DOC = Path(__file__).resolve().parents[3] / "docs" / "telemetry.md"


def doc_queries() -> list[str]:
    body = TELEMETRY_DOC.read_text().split("<!-- queries:start -->")[1].split("<!-- queries:end -->")[0]
    return re.findall(r"```sql\n(.*?)```", body, flags=re.S)


def test_the_doc_has_twelve_or_more_queries() -> None:
    assert len(doc_queries()) >= 12


def test_queries_run_and_answer(db_url: str, tmp_path: Path) -> None:
    schema.upgrade(db_url)
    w = TelemetryWriter(
        schema.make_engine(db_url), Spool(tmp_path / "s.jsonl"), flush_interval=0.02, step_sample_rate=1.0
    )
    w.start()
    for i in range(40):
        rec = record(i)
        assert rec.route is not None
        routed: dict[str, Any] = {"workload_class": "code" if i % 2 else "open_chat"}
        change: dict[str, Any] = {}
        if i % 4 == 0:  # plain decoding, faster on open chat: ngram "loses" there
            routed["spec"] = None
            change |= {"spec_decoding": {"method": None}, "completion_tokens": 200}
        if i % 5 == 1:
            change["cached_tokens"] = None  # a backend that does not report its prefix-cache hits
        if i % 10 == 9:
            change |= {"outcome": "error", "status": 503, "error_code": "overloaded"}
        if i < 12:  # routed within a replica group; every third one away from its home replica
            routed["affinity"] = {
                "group": "pool",
                "source": "user",
                "home": "a",
                "chosen": "a",
                "hit": i % 3 != 0,
            }
        change["route"] = dataclasses.replace(rec.route, **routed)
        w.submit(dataclasses.replace(rec, **change))
    assert w.flush()
    w.close()
    engine = schema.make_engine(db_url)
    with engine.connect() as conn:
        results = [conn.execute(text(q)).mappings().all() for q in doc_queries()]
    engine.dispose()
    losers = results[0]
    assert [r["workload_class"] for r in losers] == ["open_chat"]
    by_class = {(r["workload_class"], r["spec_method"]): r for r in results[1]}
    assert by_class[("code", "ngram")]["acceptance_rate"] == 0.6
    assert len(results[3]) == 4 and all(r["error_code"] == "overloaded" for r in results[3])
    assert {r["k_proposed"] for r in results[9]} == {3}
    # Every record reports 4 of its 10 prompt tokens cached, but one row in five reports nothing.
    (cached,) = results[11]
    assert cached["backend"] == "embedded" and cached["requests"] == 32 and cached["cached_share"] == 0.4
    (affinity,) = results[12]
    assert affinity["affinity_group"] == "pool" and affinity["requests"] == 12
    assert float(affinity["hit_rate"]) == pytest.approx(8 / 12)
    if db_url.startswith("postgresql"):
        assert all(r["p50_ttft_ms"] is not None for r in results[2])
