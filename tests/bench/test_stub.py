"""The stub server: its scripted cost model, prefix cache and /metrics; its canned answers; its command
line and process."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specgate.bench import launch, stub
from specgate.bench.stub import Pool, PoolConfig, copyability
from tests.bench.stub_server import ThreadServer

# Copyable: a function quoted twice (what code edits and summaries with their source look like).
CODE = (
    "Fix the bug in this function and return the whole function.\n\n"
    + "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    "    return result\n\n" * 3
)
PROSE = "Write a short poem about a lighthouse keeper who misses the sea during a long winter storm."


def chat(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "stub-pool",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **extra,
    }


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[ThreadServer]:
    config: PoolConfig = getattr(request, "param", PoolConfig())
    with ThreadServer(config) as s:
        yield s


def samples(text: str) -> dict[str, float]:
    """{name: value} of a Prometheus exposition (labels dropped; the last sample of a name wins)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = s.value
    return out


def test_the_cost_model_slows_with_the_batch_and_speculation_pays_only_when_light() -> None:
    plain, spec = Pool(PoolConfig()), Pool(PoolConfig(speculative=True))
    copy = copyability(CODE)
    assert copy > 0.2 and copyability(PROSE) == 0.0
    assert plain.step_ms(1) < plain.step_ms(8) < plain.step_ms(32)
    assert spec.step_ms(1) < spec.step_ms(8) < spec.step_ms(32)
    assert spec.step_ms(16) > plain.step_ms(16)  # verification of K drafts per sequence costs extra
    # Alone, on a copyable prompt, speculation is well over 2x faster per token...
    assert spec.ms_per_token(1, copy) < plain.ms_per_token(1, copy) / 2
    # ...but not on prose, and not in a large batch even on a copyable prompt.
    assert spec.ms_per_token(1, 0.0) > plain.ms_per_token(1, 0.0)
    assert spec.ms_per_token(48, copy) > plain.ms_per_token(48, copy)
    assert spec.acceptance(copy) > spec.acceptance(0.0) == pytest.approx(0.1)
    assert plain.tokens_per_step(0.9) == 1.0 and spec.tokens_per_step(0.0) == 1.0


async def _timed(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
        elapsed = time.perf_counter() - t0
    assert all(a.status_code == 200 for a in answers)
    return elapsed, [a.json() for a in answers]


@pytest.mark.slow
def test_measured_speculative_faster_alone_on_copyable_slower_crowded() -> None:
    scale = 0.5
    with (
        ThreadServer(PoolConfig(time_scale=scale, name="plain")) as plain,
        ThreadServer(PoolConfig(time_scale=scale, speculative=True, name="spec")) as spec,
    ):
        one = [chat(CODE, 48)]
        t_plain, _ = asyncio.run(_timed(plain.url, one))
        t_spec, [body] = asyncio.run(_timed(spec.url, one))
        assert t_spec < 0.7 * t_plain
        sd = body["metrics"]["speculative_decoding"]
        assert sd["num_accepted_draft_tokens"] > sd["num_spec_steps"]  # more than one token a step
        assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"]
        assert sd["num_draft_tokens"] == 4 * sd["num_spec_steps"]
        crowd = [chat(f"{PROSE} ({i})", 16) for i in range(24)]
        c_plain, _ = asyncio.run(_timed(plain.url, crowd))
        c_spec, answers = asyncio.run(_timed(spec.url, crowd))
        assert c_spec > 1.3 * c_plain
        assert c_plain > 16 * plain.pool.step_ms(1) / 1e3  # steps of 24 cost more than steps of 1
        assert all(a["usage"]["completion_tokens"] == 16 for a in answers)
        assert "speculative_decoding" not in asyncio.run(_timed(plain.url, one))[1][0]["metrics"]


def test_a_repeated_prefix_is_reported_cached_and_skips_prefill(server: ThreadServer) -> None:
    system = "You are the support assistant of ACME. " + "Policy: be precise and cite the manual. " * 40
    with httpx.Client(base_url=server.url, trust_env=False, timeout=30) as client:

        def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
            r = client.post(
                "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 8}
            )
            assert r.status_code == 200
            return dict(r.json())

        first = ask([{"role": "system", "content": system}, {"role": "user", "content": "Hi?"}])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        second = ask([{"role": "system", "content": system}, {"role": "user", "content": "Refunds?"}])
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompt = second["usage"]["prompt_tokens"]
        assert cached % 16 == 0 and len(system) // 4 - 16 <= cached < prompt
        assert second["metrics"]["time_to_first_token_ms"] < first["metrics"]["time_to_first_token_ms"]
        # A follow-up resends the first turn and its answer: all of it is cached, up to the new question.
        follow = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Refunds?"},
            {"role": "assistant", "content": second["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And for a broken item bought last year?"},
        ]
        third = ask(follow)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt + 8 - 16


def test_the_cache_evicts_least_recently_used_blocks() -> None:
    with ThreadServer(PoolConfig(cache_blocks=40)) as s, httpx.Client(base_url=s.url, trust_env=False) as c:

        def cached(text: str) -> int:
            r = c.post("/v1/chat/completions", json=chat(text, 1))
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        a, b = "A " * 1000, "B " * 1000  # ~31 blocks each: the cache holds one of them
        assert cached(a) == 0 and cached(a) > 0
        assert cached(b) == 0
        assert cached(a) == 0  # evicted by b


def _metric_values(url: str) -> dict[str, float]:
    return samples(httpx.get(url + "/metrics", trust_env=False).text)


@pytest.mark.parametrize("server", [PoolConfig(max_running=2, speculative=True)], indirect=True)
def test_metrics_track_running_and_waiting(server: ThreadServer) -> None:
    async def run() -> tuple[dict[str, float], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=60) as client:
            tasks = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=chat(f"{PROSE} {i}", 24)))
                for i in range(5)
            ]
            await asyncio.sleep(0.2)  # all admitted or queued; the first two decode for ~0.6 s
            during = samples((await client.get("/metrics")).text)
            return during, list(await asyncio.gather(*tasks))

    during, answers = asyncio.run(run())
    assert during["vllm:num_requests_running"] == 2
    assert during["vllm:num_requests_waiting"] == 3
    assert 0 < during["vllm:kv_cache_usage_perc"] < 1
    after = _metric_values(server.url)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    queued = [a.json()["metrics"]["queue_time_ms"] for a in answers]
    assert sorted(queued)[-1] > 300  # the last admitted waited for two answers to finish
    steps = sum(a.json()["metrics"]["speculative_decoding"]["num_spec_steps"] for a in answers)
    accepted = sum(a.json()["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] for a in answers)
    assert after["vllm:spec_decode_num_drafts_total"] == steps
    assert after["vllm:spec_decode_num_draft_tokens_total"] == 4 * steps
    assert after["vllm:spec_decode_num_accepted_tokens_total"] == accepted


def test_a_stream_respects_max_tokens_and_ends_with_usage_and_metrics(server: ThreadServer) -> None:
    body = chat(CODE, 12, stream=True, stream_options={"include_usage": True})
    events = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, trust_env=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and len(text.split()) == 12
    assert chunks[-1]["metrics"]["time_to_first_token_ms"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # The answer copies the prompt's words.
    assert set(text.split()) <= set(CODE.split())


def test_bad_requests_and_the_model_list(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url, trust_env=False) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 404  # chat only
        assert c.post("/v1/chat/completions", json={**chat("x", 1), "max_tokens": -1}).status_code == 400
        assert c.post("/v1/chat/completions", content=b"{not json").status_code == 400
        assert c.post("/v1/chat/completions", json={"messages": []}).status_code == 400
        assert c.get("/v1/models").json()["data"][0]["id"] == "stub-pool"


def test_canned_answers_json_and_streamed_with_usage() -> None:
    with (
        ThreadServer(PoolConfig(canned=True, model="m")) as s,
        httpx.Client(base_url=s.url, trust_env=False) as c,
    ):
        body = c.post("/v1/chat/completions", json=chat("hi", 50)).json()
        assert (
            body["choices"][0]["message"]["content"] == "Hello there!"
            and body["usage"]["completion_tokens"] == 3
        )
        assert body["model"] == "m" and s.pool.requests == 0  # no cost model ran
        streamed = chat("hi", 50, stream=True, stream_options={"include_usage": True})
        with c.stream("POST", "/v1/chat/completions", json=streamed) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 3
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello there!"
    )


def test_command_line_round_trip_and_process(tmp_path: Any) -> None:
    config = PoolConfig(model="pool-model", speculative=True, time_scale=0.25, max_running=3, canned=False)
    p = argparse.ArgumentParser()
    stub.add_arguments(p)
    port = launch.free_port()
    cmd = stub.command(config, port)
    assert cmd[1:5] == ["-m", "specgate.gateway.cli.main", "bench", "stub"]
    assert stub.config_of(p.parse_args(cmd[5:])) == config
    with launch.running(cmd, tmp_path / "stub.log", f"http://127.0.0.1:{port}/health", 60) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat(CODE, 4), trust_env=False, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "pool-model"
        assert "speculative_decoding" in r.json()["metrics"]
