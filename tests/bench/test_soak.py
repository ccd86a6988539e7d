"""`specgate bench soak` end to end, briefly: a database outage and a backend kill inside 16 seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgate.gateway.cli.main import main

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_a_short_soak_loses_nothing(tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    code = main(
        [
            "bench",
            "soak",
            "--seconds",
            "16",
            "--concurrency",
            "8",
            "--model",
            str(tiny_llama_dir),
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    report = json.loads((out / "soak.json").read_text())
    assert code == 0, report
    assert report["requests"] > 50 and report["responses_500"] == 0
    assert report["telemetry_rows"] == report["requests"] and report["kv_blocks_held_when_idle"] == 0
    assert {"database_down_at_s", "database_back_at_s", "backend_killed_at_s", "backend_back_at_s"} <= set(
        report["events"]
    )
    assert report["statuses"].get("400", 0) > 0 and report["client_disconnects"] > 0
