"""The side-by-side table of specgate's arms against the llama.cpp peer, per load point and category.

Per cell: TTFT p50, TPOT p50, per-request output tokens/s (mean of tokens / E2E) and mean output
tokens, so that unequal answer lengths would still compare fairly. Aggregate output tokens/s is
given for the whole load point only: the categories are interleaved in one run and share its wall
clock, so a per-category aggregate would only repeat the run's duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specgate.bench.serve.metrics import RequestResult, ms, number, over, percentile
from specgate.bench.serve.peer_server import PEER

ALL = "all"


def cell(results: Sequence[RequestResult], aggregate: float | None) -> dict[str, float | int | None]:
    ok = [r for r in results if r.ok and r.e2e]
    rates = [r.output_tokens / r.e2e for r in ok if r.e2e]
    return {
        "requests": len(ok),
        "ttft_p50_ms": ms(percentile([r.ttft for r in ok if r.ttft is not None], 50)),
        "tpot_p50_ms": ms(percentile([r.tpot for r in ok if r.tpot is not None], 50)),
        "tokens_per_s": sum(rates) / len(rates) if rates else None,
        "output_tokens": sum(r.output_tokens for r in ok) / len(ok) if ok else None,
        "aggregate_tokens_per_s": aggregate,
    }


def ratios(arm: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """arm / peer for each measure: above 1 is better for tokens/s, worse for TTFT and TPOT."""
    keys = ("tokens_per_s", "aggregate_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")
    return {k: over(arm.get(k), peer.get(k)) for k in keys}


def table(runs: Sequence[dict[str, Any]], peer: str = PEER) -> list[dict[str, Any]]:
    """One row per (load point, category or "all", arm); `runs` as the harness keeps them (with
    "results"). Rows of other arms carry `vs_peer` when the peer ran at that point."""
    rows: list[dict[str, Any]] = []
    for point in dict.fromkeys(r["point"] for r in runs):
        at = [r for r in runs if r["point"] == point]
        cats = dict.fromkeys(res.category for r in at for res in r["results"])
        for cat in (ALL, *cats):
            cells = {
                r["arm"]: cell(
                    [res for res in r["results"] if cat in (ALL, res.category)],
                    r["summary"]["output_throughput"] if cat == ALL else None,
                )
                for r in at
            }
            base = cells.get(peer)
            for arm, c in cells.items():
                row: dict[str, Any] = {"point": point, "category": cat, "arm": arm, **c}
                if base is not None and arm != peer:
                    row["vs_peer"] = ratios(c, base)
                rows.append(row)
    return rows


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def markdown(rows: Sequence[dict[str, Any]], peer: str = PEER) -> list[str]:
    lines = [
        f"## Against {peer} (same GGUF and requests, one server at a time)",
        "",
        f"tok/s per request: mean of output tokens / E2E. Ratios are arm / {peer}: above 1 is faster "
        "for tokens/s.",
        "",
        f"| point | category | arm | TTFT p50 ms | TPOT p50 ms | out tok | tok/s per request "
        f"| aggregate tok/s | tok/s vs {peer} | aggregate vs {peer} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = r.get("vs_peer") or {}
        cells = [
            r["point"],
            r["category"],
            r["arm"],
            number(r["ttft_p50_ms"]),
            number(r["tpot_p50_ms"]),
            number(r["output_tokens"], 0),
            number(r["tokens_per_s"]),
            number(r["aggregate_tokens_per_s"]),
            _x(vs.get("tokens_per_s")),
            _x(vs.get("aggregate_tokens_per_s")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [
        f"- {r['point']}: {r['arm']} / {peer}: {_x(r['vs_peer']['tokens_per_s'])} tokens/s per request, "
        f"{_x(r['vs_peer']['aggregate_tokens_per_s'])} aggregate tokens/s"
        for r in rows
        if r["category"] == ALL and "vs_peer" in r
    ]
    return lines
