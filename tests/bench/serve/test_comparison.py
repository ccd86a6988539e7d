"""The specgate-vs-llama.cpp table: cells, ratios, rows per load point and category, the markdown."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.bench.serve import comparison
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.peer_server import PEER


def result(arm: str, category: str, ttft: float, e2e: float, tokens: int = 11) -> RequestResult:
    return RequestResult(
        f"{arm}-{category}",
        category,
        arm,
        sent_at=0.0,
        ok=True,
        output_tokens=tokens,
        chunk_times=[ttft, e2e],
        done_at=e2e,
    )


def run(arm: str, point: str, e2e: float, throughput: float) -> dict[str, Any]:
    results = [result(arm, "code", 0.1, e2e), result(arm, "qa", 0.3, 2 * e2e)]
    return {"arm": arm, "point": point, "summary": {"output_throughput": throughput}, "results": results}


def test_cell_measures_one_group() -> None:
    c = comparison.cell([result("a", "code", 0.1, 1.1), result("a", "code", 0.3, 2.3)], 42.0)
    assert c["requests"] == 2 and c["output_tokens"] == 11
    assert c["ttft_p50_ms"] == pytest.approx(200.0)
    assert c["tpot_p50_ms"] == pytest.approx((100.0 + 200.0) / 2)  # (E2E - TTFT) / 10 tokens
    assert c["tokens_per_s"] == pytest.approx((11 / 1.1 + 11 / 2.3) / 2)
    assert c["aggregate_tokens_per_s"] == 42.0
    failed = RequestResult("x", "code", "a", 0.0, ok=False)
    assert comparison.cell([failed], None)["tokens_per_s"] is None


def test_ratios_are_arm_over_peer_and_none_without_data() -> None:
    r = comparison.ratios(
        {"tokens_per_s": 30.0, "tpot_p50_ms": 10.0}, {"tokens_per_s": 20.0, "tpot_p50_ms": 20.0}
    )
    assert r == {"tokens_per_s": 1.5, "aggregate_tokens_per_s": None, "ttft_p50_ms": None, "tpot_p50_ms": 0.5}


def test_table_rows_per_point_category_and_arm() -> None:
    runs = [run("policy", "c=1", 1.0, 40.0), run("plain", "c=1", 2.0, 20.0), run(PEER, "c=1", 4.0, 10.0)]
    runs.append(run("policy", "c=4", 1.0, 80.0))  # no peer at this point: no ratios
    rows = comparison.table(runs)
    keys = [(r["point"], r["category"], r["arm"]) for r in rows]
    assert keys[:9] == [
        (p, c, a) for p in ["c=1"] for c in ["all", "code", "qa"] for a in ["policy", "plain", PEER]
    ]
    assert keys[9:] == [("c=4", c, "policy") for c in ["all", "code", "qa"]]
    first = rows[0]
    assert first["aggregate_tokens_per_s"] == 40.0 and first["vs_peer"]["aggregate_tokens_per_s"] == 4.0
    assert first["vs_peer"]["tokens_per_s"] == pytest.approx(4.0)
    assert rows[3]["aggregate_tokens_per_s"] is None  # per category: no aggregate (shared wall clock)
    assert "vs_peer" not in rows[2] and "vs_peer" not in rows[9]


def test_markdown_table_and_summary_lines() -> None:
    runs = [run("policy", "c=1", 1.0, 40.0), run(PEER, "c=1", 4.0, 10.0)]
    lines = comparison.markdown(comparison.table(runs))
    assert lines[0].startswith(f"## Against {PEER}")
    assert any(
        line.startswith("| c=1 | all | policy | 200.0 |") and "| 4.00x | 4.00x |" in line for line in lines
    )
    assert any(
        line.startswith(f"| c=1 | code | {PEER} |") and line.endswith("| - | - | - |") for line in lines
    )
    assert f"- c=1: policy / {PEER}: 4.00x tokens/s per request, 4.00x aggregate tokens/s" in lines
