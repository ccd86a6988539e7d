"""`specgate bench families serve` measures through bench/serve/interleaved.py: its report keeps its
shape (stub servers on loopback stand in for llama-server and specgate; no model runs)."""

from __future__ import annotations

import argparse
import asyncio
import time
from functools import partial

import pytest

from specgate.bench import families
from specgate.bench.serve.datasets import BenchRequest
from specgate.bench.serve.interleaved import Arm, at_point
from specgate.bench.serve.peer_server import PEER
from specgate.bench.serve.runner import PLAIN
from tests.bench.serve.test_interleaved import stub_servers


def test_one_and_two_in_flight() -> None:
    args = argparse.Namespace(requests=3, requests_in_flight=None)
    reqs = [
        BenchRequest("qa", [{"role": "user", "content": f"question {i} about the sea"}], 6) for i in range(2)
    ]
    with stub_servers(20.0, 10.0) as (llama_stub, specgate_stub):
        llama = Arm(
            families.LLAMA_ARM, llama_stub.url, PEER, "m", {"ignore_eos": True, "cache_prompt": False}
        )
        specgate = Arm(families.SPECGATE_ARM, specgate_stub.url, PLAIN, "", {"ignore_eos": True})
        arms = [llama, specgate]
        deadline = time.monotonic() + 60
        one = asyncio.run(at_point(arms, partial(families._measure_arms, args, arms, reqs, 1, deadline)))
        two = asyncio.run(at_point(arms, partial(families._measure_arms, args, arms, reqs, 2, deadline)))
    assert set(one) == {
        "in_flight",
        families.LLAMA_ARM,
        families.SPECGATE_ARM,
        "tpot_ratio_llama_over_specgate",
        "loadavg",
    }
    sg = one[families.SPECGATE_ARM]
    assert (sg["requests"], sg["failed"], sg["output_tokens"]) == (3, 0, [6, 6, 6])
    assert one["tpot_ratio_llama_over_specgate"] == pytest.approx(2.0, rel=0.15)
    assert f"llama-server/specgate {one['tpot_ratio_llama_over_specgate']:.2f}" in families._summary(one)
    a, b = families.LLAMA_ARM, families.SPECGATE_ARM
    assert [p["arm"] for p in two["phases"]] == [a, b, b, a]
    assert all(p["requests"] == 4 and p["failed"] == 0 for p in two["phases"])  # 2N a phase
    assert len(two[families.SPECGATE_ARM]["tok_s"]) == 2
    assert two["tok_s_ratio_specgate_over_llama"] == pytest.approx(2.0, rel=0.2)
    assert "(A-B-B-A)" in families._summary(two)
