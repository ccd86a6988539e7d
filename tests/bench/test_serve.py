"""`specgate bench serve`: vLLM's serving metrics from per-request timings, and end to end on the tiny
model: the report builds, its counts match telemetry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgate.bench.client import RequestResult
from specgate.bench.serve import summarize
from specgate.gateway.cli.main import main


def stream(
    rid: str, sent: float, chunks: list[float], tokens: int, done: float, **spec: object
) -> RequestResult:
    r = RequestResult(
        rid, "code", "ngram", sent_at=sent, ok=True, output_tokens=tokens, chunk_times=chunks, done_at=done
    )
    r.spec = dict(spec)
    return r


def test_summary_throughput_goodput_and_acceptance() -> None:
    results = [
        stream(
            "a",
            0.0,
            [0.1, 0.2],
            tokens=11,
            done=1.1,
            num_drafts=4,
            num_draft_tokens=12,
            num_accepted_tokens=6,
            num_accepted_tokens_per_pos=[4, 2, 0],
        ),
        stream(
            "b",
            0.0,
            [0.5, 0.9],
            tokens=21,
            done=2.5,
            num_drafts=2,
            num_draft_tokens=6,
            num_accepted_tokens=0,
            num_accepted_tokens_per_pos=[0, 0, 0],
        ),
        RequestResult("c", "code", "ngram", sent_at=0.0, ok=False, error="APIError: boom"),
    ]
    s = summarize(results, duration=4.0, slos={"ttft": 200, "tpot": 100})
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["output_throughput"] == pytest.approx(32 / 4.0) and s["request_throughput"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(1 / 4.0)  # b misses the TTFT SLO (500 ms > 200 ms)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((100.0 + 100.0) / 2)  # a: 1.0 s / 10; b: 2.0 s / 20
    sp = s["spec"]
    assert sp["mean_acceptance_length"] == pytest.approx((6 + 6) / 6) and sp[
        "acceptance_rate"
    ] == pytest.approx(6 / 18)
    assert sp["acceptance_by_position"] == pytest.approx([4 / 6, 2 / 6, 0.0])
    assert summarize(results, 4.0)["goodput"] is None  # no SLOs given


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


@pytest.mark.slow
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


@pytest.mark.slow
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
    args += ["--dataset-path", str(data), "--arms", "plain", "--concurrency", "1"]
    assert main(args) == 1
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["runs"][0]["summary"]["failed"] == 1 and "context length" in rep["runs"][0]["errors"][0]
    assert rep["telemetry"]["agree"]  # the refused request has its row too
