"""`specgate bench serve` end to end on the tiny model: the report builds, counts match telemetry."""

from __future__ import annotations

import json
from pathlib import Path

from specgate.gateway.cli.main import main

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# The tiny model holds 512 one-character tokens: short prompts of three categories.
PROMPTS = [
    {"prompt": "def add(a, b):", "category": "code"},
    {"prompt": "def sub(a, b):", "category": "code"},
    {"prompt": "Doc: the sky is blue. Q: what colour is the sky?", "category": "rag"},
    {"prompt": "Doc: grass is green. Q: what colour is grass?", "category": "rag"},
    {"messages": [{"role": "user", "content": "call f"}], "tools": [TOOL], "category": "tool_call"},
    {"messages": [{"role": "user", "content": "call f now"}], "tools": [TOOL], "category": "tool_call"},
]


def test_a_run_builds_a_report_that_reconciles_with_telemetry(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    args = ["bench", "serve", "--model", str(tiny_llama_dir), "--dtype", "float32", "--out", str(out)]
    args += ["--dataset-path", str(data), "--max-tokens", "8", "--arms", "policy,plain,ngram"]
    args += ["--concurrency", "1,2", "--slo", "ttft=5000,tpot=1000"]
    rc = main(args)
    rep = json.loads((out / "report.json").read_text())
    assert rc == 0, [r["errors"] for r in rep["runs"]]
    assert [(r["arm"], r["point"]) for r in rep["runs"]] == [
        (a, p) for p in ("c=1", "c=2") for a in ("policy", "plain", "ngram")
    ]
    for run in rep["runs"]:
        s = run["summary"]
        assert s["completed"] == s["requests"] == 6 and s["failed"] == 0
        assert s["ttft_ms"]["p50"] > 0 and s["output_throughput"] > 0 and s["goodput"] is not None
    assert rep["telemetry"] == {**rep["telemetry"], "rows": 36, "sent": 36, "agree": True}
    assert set(rep["categories"]) == {"code", "rag", "tool_call"}
    assert rep["categories"]["code"]["plain"]["route_mix"] == {"off": 2}
    assert rep["categories"]["code"]["ngram"]["route_mix"] == {"ngram": 2}
    md = (out / "report.md").read_text()
    assert (
        "| policy | c=1 | 6/6 |" in md and "Telemetry cross-check: 36 rows for 36 requests sent (agree)" in md
    )
    for png in rep["plots"]:
        assert (out / png).stat().st_size > 1000


def test_failed_requests_make_the_run_fail(tiny_llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "x" * 600}))  # longer than the tiny model's context
    args = [
        "bench",
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--dtype",
        "float32",
        "--out",
        str(tmp_path / "o"),
    ]
    args += ["--dataset-path", str(data), "--arms", "plain", "--concurrency", "1", "--no-plots"]
    assert main(args) == 1
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["runs"][0]["summary"]["failed"] == 1 and "context length" in rep["runs"][0]["errors"][0]
    assert rep["telemetry"]["agree"]  # the refused request has its row too
