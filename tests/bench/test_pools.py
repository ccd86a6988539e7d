"""`specgate bench pools` end to end at toy sizes: stubs and `specgate serve` processes, both parts,
one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgate.gateway.cli.main import main

TINY = [
    "--time-scale", "0.2", "--max-tokens", "16",
    "--train-levels", "2,8", "--train-per-level", "12",
    "--light-batch", "4", "--light-batches", "1", "--heavy", "4", "--heavy-batches", "1",
    "--families", "3", "--shared-families", "1", "--questions", "2", "--follow-up-share", "0.5",
    "--system-chars", "1200", "--prefix-concurrency", "3", "--prefix-max-tokens", "8",
    "--replica-cache-blocks", "64",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_run_reports_both_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert main(["bench", "pools", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Two pools" in printed and "Shared prefix over 3 replicas" in printed
    report = json.loads(printed.strip().splitlines()[-1])  # the last line: the JSON report
    assert report == json.loads(out.read_text())

    pools = report["pools"]
    training = pools["training"]
    assert sum(training["routed"].values()) == 24
    assert training["active_kind"] == "learned"  # retrained (forced if the gateway declined)
    table = pools["table"]
    assert set(table) >= {"light/all", "heavy/all", "both/all"}
    for row in table.values():
        assert set(row["goodput"]) == {"learned", "spec", "plain", "split"}
        assert all(v > 0 for v in row["goodput"].values())
        assert 0.0 <= row["learned_to_spec"] <= 1.0 and row["ci95"][0] <= row["ratio"] <= row["ci95"][1]
        assert row["vs_split_ci95"][0] <= row["vs_split"] <= row["vs_split_ci95"][1]
    assert table["light/all"]["n"] == 4 and table["heavy/all"]["n"] == 8
    assert len(pools["goals"]) == 3

    prefix = report["prefix"]
    for mode in ("prefix", "session", "off"):
        row = prefix[mode]
        # 3 families x 2 questions, plus the follow-ups drawn for the first round's turns.
        assert row["requests"] >= 6 and sum(row["per_replica"]) == row["requests"]
        assert row["stub_requests"] == row["per_replica"]  # the route names the replica that served
        assert 0.0 <= row["cached_share"] < 1.0 and row["ttft_p50_ms"] > 0
    assert prefix["prefix"]["requests"] == prefix["session"]["requests"] == prefix["off"]["requests"]
    assert (
        prefix["ttft_off_ratio_ci95"][0]
        <= prefix["ttft_p50_off_over_prefix"]
        <= prefix["ttft_off_ratio_ci95"][1]
    )
    assert len(prefix["goals"]) == 3
