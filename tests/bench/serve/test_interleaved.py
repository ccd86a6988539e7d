"""Interleaved measurement: the rotation and palindrome orders, what each request carries, the
paired ratios and their intervals, and one run against two real loopback servers of known speed."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from specgate.bench.serve import interleaved
from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.interleaved import ALL, Arm, Sender
from specgate.bench.serve.metrics import RequestResult
from specgate.bench.serve.peer_server import PEER
from specgate.bench.serve.runner import PLAIN, POLICY
from specgate.bench.stub_pool import PoolConfig, ThreadServer
from tests.bench.serve.test_peer_arm import FakeClient, chunk


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
    past = time.monotonic() - 1
    assert asyncio.run(interleaved.one_in_flight(arms, 4, fake_send([]), deadline=past)) == {
        "A": [],
        "B": [],
        "C": [],
    }


def test_phases_are_closed_loops_in_palindrome_order() -> None:
    log: list[tuple[str, int, str]] = []
    arms = [Arm("A", ""), Arm("B", "")]
    done = asyncio.run(interleaved.phases(arms, 6, 3, fake_send(log)))
    assert [p.arm for p in done] == ["A", "B", "B", "A"]
    assert [p.summary()["requests"] for p in done] == [6, 6, 6, 6]
    assert {(a, p) for a, _, p in log} == {("A", "c3-0"), ("B", "c3-1"), ("B", "c3-2"), ("A", "c3-3")}
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
    servers = [
        ThreadServer(PoolConfig(name=f"s{i}", step_base_ms=ms, step_per_seq_ms=0.0, cache_blocks=0))
        for i, ms in enumerate(step_ms)
    ]
    for s in servers:
        s.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


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
