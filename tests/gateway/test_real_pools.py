"""The gateway in front of two real llama.cpp servers declared as two pools of one public model:
llama-cpp-python's server (on the embedded default model's GGUF) with prompt-lookup speculation, and
the same server without it. The routing policy picks the pool per request; telemetry goes to SQLite.

    specgate --- "smollm2" --+--> lookup: llama_cpp.server --draft_model prompt-lookup-decoding
                             +--> plain:  llama_cpp.server

What llama-cpp-python 0.3.36 is, as these tests found it (they assert it where it is the gateway's
business):

- Its answers carry no `timings` (llama.cpp's own server does) and no `metrics`: `id`, `object`,
  `created`, `model`, `choices`, `usage` only. It has no /metrics either (404). Its streams carry
  no usage, even asked (`stream_options.include_usage`, which the gateway always sends): one chunk
  per token, the role in a chunk of its own just before the first.
- By default (`interrupt_requests`) it cuts a running stream short as soon as any other request
  that takes its model lock arrives, a GET /v1/models included, which is the gateway's health
  probe: it sends `[DONE]` at once, with no final chunk and no finish reason. The pools here run
  with `--interrupt_requests false` (a probe then waits for the answer to end); the one test of
  what the gateway makes of a stream cut that way runs a server of its own with the default.
- Its prompt lookup cannot run with `--n_batch 1`: it evaluates the sampled token and its drafts in
  one `eval` and samples each drafted position at a negative index into the last decode's outputs
  (`Llama.sample`: idx - n_tokens), so a decode of one token leaves the sampler asking for output
  -5 of 1 and llama.cpp aborts (`get_logits_ith: invalid logits id -5` / GGML_ASSERT). It needs
  n_batch >= 1 + the draft length. Multi-token batches in turn die with SIGILL on AMX-INT8 CPUs
  with the weights repacked for AMX (test_real_backends.py keeps n_batch 1 for that reason), so
  both servers here run with the repack off (`LlamaServer(repack=False)`) and the same n_batch.
- Greedy answers of the two servers are not always the same text. The lookup is lossless as an
  algorithm (a draft token is kept only where the target's own argmax agrees), but llama.cpp's CPU
  logits depend on the shape of the batch that computed them: a drafted position is verified in a
  batch of up to five tokens (and its KV entry written there), a plain server's in a batch of one,
  and their logprobs differ in the second decimal. Where the model's top two tokens are that close,
  the argmax flips and the texts part. Plain servers alone do the same: n_batch 1 and n_batch 8
  give different greedy text for the same prompt (and a prompt-prefix cache hit changes the batch
  boundaries too). So the test asserts what holds: where the model is sure (an echo prompt, which
  is what prompt lookup drafts and accepts) the texts are identical, and wherever two answers part,
  the two tokens are a near-tie in both servers' own logprobs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa

from specgate.gateway.telemetry.tables import requests
from tests.gateway.fake_upstream import HTTP, backend, openai_client, running_gateway
from tests.gateway.live import ADMIN_HEADERS, LiveGateway, wait_for
from tests.gateway.llama_servers import ALIAS, LlamaServer

pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is a dev dependency")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

Messages = list[Any]  # chat messages, as the openai client takes them
Answer = list[tuple[str, dict[str, float]]]  # a greedy answer's tokens, each with its top logprobs

MODEL = "smollm2"  # the public model both pools serve
LOOKUP_ARM = "lookup:upstream-ngram"
PLAIN_ARM = "plain:upstream"
DRAFT_TOKENS = 4
N_BATCH = 8  # >= 1 + DRAFT_TOKENS: see the module's docstring
HEALTH_INTERVAL = 1.0  # health probe and /metrics scrape of each backend, seconds
NEAR_TIE = 0.3  # nats: a top-two gap this small may flip with the batch's shape
ECHO = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]
PROMPTS = [
    ECHO,
    [{"role": "user", "content": "Repeat exactly: one two three four five six seven eight."}],
    [{"role": "user", "content": "List the days of the week."}],
]


@dataclass
class Pools:
    lookup: LlamaServer
    plain: LlamaServer
    live: LiveGateway
    db: sa.Engine


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaServer, LlamaServer]]:
    logs = tmp_path_factory.mktemp("llama")
    # Batches on one thread too (its default is one per core): two servers' OpenMP teams spinning on
    # two shared cores cost tens of seconds. No stream cut short by the gateway's health probes.
    one_thread = ["--n_threads_batch", "1", "--interrupt_requests", "false"]
    draft = ["--draft_model", "prompt-lookup-decoding", "--draft_model_num_pred_tokens", str(DRAFT_TOKENS)]
    lookup = LlamaServer(logs, name="lookup", n_batch=N_BATCH, repack=False, extra_args=[*one_thread, *draft])
    # The same server in every setting but the draft model.
    plain = LlamaServer(logs, name="plain", n_batch=N_BATCH, repack=False, extra_args=one_thread)
    try:
        for server in (lookup, plain):
            server.spawn()  # both load at once
        for server in (lookup, plain):
            server.wait_ready()
        # A server's first answer pages its weights in and compiles its chat template: both at once.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: greedy_with_logprobs(s, ECHO, max_tokens=1), (lookup, plain)))
        yield lookup, plain
    finally:
        lookup.stop()
        plain.stop()


@pytest.fixture(scope="module")
def pools(
    servers: tuple[LlamaServer, LlamaServer], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pools]:
    lookup, plain = servers
    db = tmp_path_factory.mktemp("telemetry") / "telemetry.db"
    knobs: dict[str, Any] = dict(
        models={MODEL: ALIAS},
        max_retries=0,
        breaker_failures=1,
        breaker_cooldown=60.0,  # a dead pool stays out for the rest of the module
        health_interval=HEALTH_INTERVAL,
        read_timeout=60.0,
        total_timeout=60.0,
    )
    with running_gateway(
        backend("lookup", lookup.base_url, speculative="ngram", **knobs),
        backend("plain", plain.base_url, speculative="off", **knobs),
        telemetry={"url": f"sqlite:///{db}", "auto_upgrade": True, "flush_interval": 0.05},
        policy={"seed": 0},  # the exploration draws, reproducible
    ) as live:
        engine = sa.create_engine(f"sqlite:///{db}")
        try:
            yield Pools(lookup, plain, live, engine)
        finally:
            engine.dispose()


# ---- helpers -------------------------------------------------------------------------------------


def set_rules(live: LiveGateway, **rules: Any) -> None:
    r = HTTP.put(f"{live.url}/admin/policy", json={**rules, "note": "test_real_pools"}, headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text


def chat(live: LiveGateway, messages: Messages, max_tokens: int = 12) -> tuple[str, str, Any]:
    """One greedy chat answer through the gateway: its client request id, text and `metrics.route`."""
    rid = f"pools-{uuid.uuid4().hex[:12]}"
    resp = openai_client(live, timeout=60).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_headers={"x-request-id": rid},
    )
    assert resp.model == MODEL
    return rid, resp.choices[0].message.content or "", (resp.model_extra or {})["metrics"]["route"]


def chat_stream(live: LiveGateway, messages: Messages, max_tokens: int = 12) -> tuple[str, str, Any]:
    rid = f"pools-{uuid.uuid4().hex[:12]}"
    chunks = list(
        openai_client(live, timeout=60).chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            extra_headers={"x-request-id": rid},
        )
    )
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return rid, text, (finals[0].model_extra or {})["metrics"]["route"]


def rows(pools: Pools, *rids: str, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """The telemetry rows of these client request ids, once the writer has flushed them all."""
    found: dict[str, dict[str, Any]] = {}

    def landed() -> bool:
        with pools.db.connect() as conn:
            for row in conn.execute(sa.select(requests).where(requests.c.client_request_id.in_(rids))):
                found[row.client_request_id] = dict(row._mapping)
        return len(found) == len(rids)

    assert wait_for(landed, timeout, interval=0.05), f"rows of {sorted(set(rids) - set(found))} never landed"
    return found


def backend_status(live: LiveGateway) -> dict[str, dict[str, Any]]:
    r = HTTP.get(f"{live.url}/admin/backends", headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    return {b["name"]: b for b in r.json()["backends"]}


def greedy_with_logprobs(server: LlamaServer, messages: Messages, max_tokens: int = 16) -> Answer:
    """A server's own greedy answer, token by token, each with its top two logprobs."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    resp = client.chat.completions.create(
        model=ALIAS,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    logprobs = resp.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    out = [(t.token, {c.token: c.logprob for c in t.top_logprobs}) for t in logprobs.content]
    assert "".join(tok for tok, _ in out) == resp.choices[0].message.content
    return out


def parting(a: Answer, b: Answer) -> int | None:
    """The first position where two answers chose different tokens; None where one is the other's prefix."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0]), None)


def gap(top: dict[str, float], chosen: str, other: str) -> float:
    """How far `other` trailed `chosen` in one server's own logprobs (inf: not in its top two)."""
    return top[chosen] - top[other] if other in top else float("inf")


def wait_for_scrape(server: LlamaServer, timeout: float = 5 * HEALTH_INTERVAL) -> None:
    """Until the gateway's health loop has just probed and scraped `server` (its access log shows the
    next GET /metrics): the next probe is a whole health interval away."""

    def scrapes() -> int:
        return server.log.read_text(errors="replace").count('"GET /metrics ')

    seen = scrapes()
    assert wait_for(lambda: scrapes() > seen, timeout, interval=0.01), "the gateway never scraped the server"


# ---- the tests -----------------------------------------------------------------------------------


def test_greedy_answers_agree_but_where_the_model_is_torn(servers: tuple[LlamaServer, LlamaServer]) -> None:
    lookup, plain = servers
    answers: dict[str, tuple[Answer, Answer]] = {}
    with ThreadPoolExecutor(2) as pool:  # one server per core
        for messages in PROMPTS:
            a, b = pool.map(greedy_with_logprobs, (plain, lookup), (messages, messages))
            answers[messages[0]["content"]] = (a, b)
    parted: list[str] = []
    for prompt, (a, b) in answers.items():
        i = parting(a, b)
        if i is None:
            assert len(a) == len(b), (a, b)  # greedy to the same max_tokens: the same length too
            continue
        # They part only at a near-tie, in both servers' own logprobs: the numerics of the batch a
        # drafted position was verified in, never a draft kept against the target's own argmax.
        (x, top_a), (y, top_b) = a[i], b[i]
        assert gap(top_a, x, y) < NEAR_TIE and gap(top_b, y, x) < NEAR_TIE, (prompt, i, a[i], b[i])
        parted.append(f"{prompt!r} at token {i}: plain {x!r} {top_a}, lookup {y!r} {top_b}")
    print("\n".join(parted) or "no answers parted")
    # The echo prompt is prompt lookup's own case (its drafts come from the prompt, and are
    # accepted), and the model is sure of every token: the same text from both.
    a, b = answers[ECHO[0]["content"]]
    assert [t for t, _ in a] == [t for t, _ in b]


def test_both_pools_serve_as_their_arms_with_the_propensity_logged(pools: Pools) -> None:
    set_rules(pools.live, exploration_rate=0.5, exploration_cap=1.0)
    served = [chat(pools.live, ECHO, max_tokens=8) for _ in range(8)]
    arms = {route["arm"] for _, _, route in served}
    assert arms == {LOOKUP_ARM, PLAIN_ARM}, [r["arm"] for _, _, r in served]
    for _, _, route in served:
        assert route["backend"] == route["arm"].split(":")[0]
        assert route["policy"] == "rules" and route["propensity"] == 0.5
        # The rules send a speculating class (every class at temperature 0) to the speculative
        # pool; the plain one is the exploration's.
        assert route["explored"] is (route["arm"] == PLAIN_ARM)
        assert "chosen_arm" not in route  # the chosen pool served
    # Greedy, and the model is sure of every token: one text, whichever server answered.
    assert len({text for _, text, _ in served}) == 1, served

    written = rows(pools, *(rid for rid, _, _ in served))
    for rid, _, route in served:
        row = written[rid]
        assert row["status"] == 200 and row["outcome"] == "ok"
        assert row["backend"] == route["backend"]
        assert row["route"]["arm"] == route["arm"]
        assert row["route"].get("chosen_arm") is None
        assert row["propensity"] == 0.5
        assert row["policy"] == "rules" and row["policy_version"] == route["policy_version"]
    assert {r["route"]["arm"] for r in written.values()} == {LOOKUP_ARM, PLAIN_ARM}


def test_no_metrics_endpoint_leaves_the_load_to_the_gateways_counts(pools: Pools) -> None:
    # llama-cpp-python's server has no /metrics.
    assert httpx.get(f"http://127.0.0.1:{pools.plain.port}/metrics", timeout=5).status_code == 404

    def scraped() -> bool:
        return all(b["metrics"]["error"] is not None for b in backend_status(pools.live).values())

    assert wait_for(scraped, 5 * HEALTH_INTERVAL), backend_status(pools.live)
    status = backend_status(pools.live)
    assert set(status) == {"lookup", "plain"}
    assert status["lookup"]["speculation"] == "ngram" and status["plain"]["speculation"] is None
    for name, b in status.items():
        metrics = b["metrics"]
        assert "404" in metrics["error"], (name, metrics)
        assert metrics["load_source"] == "gateway", (name, metrics)
        assert metrics["running"] is None and metrics["waiting"] is None and metrics["kv_usage"] is None
        assert b["healthy"] is True and b["breaker"] == "closed"
        load = b["policy_load"]
        assert load["running"] is None and load["waiting"] is None and load["in_flight"] == 0

    # The load the router reads is this gateway's own count of requests in flight there: asked while
    # a stream is open (an answer of 24 tokens, all of them: the first is in when we ask).
    long = [{"role": "user", "content": "List the days of the week."}]
    body = {"model": MODEL, "messages": long, "max_tokens": 24, "temperature": 0.0, "stream": True}
    with HTTP.stream("POST", f"{pools.live.url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        during = backend_status(pools.live)
        tail = [line for line in lines if line.startswith("data: {")]
    final = next(c for c in map(json.loads, (t.removeprefix("data: ") for t in tail)) if "metrics" in c)
    serving = final["metrics"]["route"]["backend"]
    other = "plain" if serving == "lookup" else "lookup"
    assert during[serving]["in_flight"] == 1 and during[serving]["policy_load"]["in_flight"] == 1
    assert during[other]["in_flight"] == 0
    assert during[serving]["policy_load"]["running"] is None  # still nothing from the server itself


def test_timings_are_null_without_a_measure_and_measured_when_streamed(pools: Pools) -> None:
    # What llama-cpp-python reports with an answer: no `timings` (llama.cpp's own server's field),
    # no `metrics`; only the OpenAI fields and `usage`.
    raw = httpx.post(
        f"{pools.plain.base_url}/chat/completions",
        json={"model": ALIAS, "messages": ECHO, "max_tokens": 4, "temperature": 0.0},
        timeout=60,
    ).json()
    assert set(raw) == {"id", "object", "created", "model", "choices", "usage"}, raw
    assert set(raw["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    body = {"model": ALIAS, "messages": ECHO, "max_tokens": 4, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with HTTP.stream("POST", f"{pools.plain.base_url}/chat/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events and not any("usage" in e or "timings" in e for e in events), events

    rid, _, route = chat(pools.live, ECHO, max_tokens=16)
    rid_s, _, route_s = chat_stream(pools.live, ECHO, max_tokens=16)
    written = rows(pools, rid, rid_s)
    row, row_s = written[rid], written[rid_s]
    # Non-streamed: the whole answer arrived at once and the server measured nothing, so its time to
    # first token and per output token are unknown: NULL, neither 0 nor the whole request's time.
    assert row["stream"] is False and row["completion_tokens"] and row["completion_tokens"] >= 2
    assert row["first_token_time"] is None
    assert row["ttft_ms"] is None and row["tpot_ms"] is None, (row["ttft_ms"], row["tpot_ms"])
    assert row["e2e_ms"] is not None and row["e2e_ms"] > 0
    assert row["upstream"] is None  # nothing of the server's own to keep
    assert "upstream" not in route
    # Streamed: the gateway saw the first token arrive. The server says nothing of the tokens' count
    # (no usage chunk, though asked): unknown, so no time per output token either; NULL again.
    assert row_s["stream"] is True and row_s["first_token_time"] is not None
    assert row_s["ttft_ms"] is not None and 0 < row_s["ttft_ms"] < row_s["e2e_ms"], row_s
    assert row_s["completion_tokens"] is None and row_s["tpot_ms"] is None, row_s
    assert row_s["backend"] == route_s["backend"]


@pytest.fixture
def cut(tmp_path: Path) -> Iterator[tuple[LlamaServer, LiveGateway, sa.Engine]]:
    """llama-cpp-python's server as it starts by default (it interrupts streams), alone behind a
    gateway that never probes it: the test decides when another request reaches it."""
    server = LlamaServer(tmp_path, name="cut")
    server.start()
    try:
        with running_gateway(
            backend("cut", server.base_url, models={MODEL: ALIAS}, max_retries=0, read_timeout=60.0),
            telemetry={"url": f"sqlite:///{tmp_path / 't.db'}", "auto_upgrade": True, "flush_interval": 0.05},
        ) as live:
            engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
            try:
                yield server, live, engine
            finally:
                engine.dispose()
    finally:
        server.stop()


def test_a_stream_the_server_cuts_short_is_not_passed_off_as_complete(
    cut: tuple[LlamaServer, LiveGateway, sa.Engine],
) -> None:
    server, live, engine = cut
    days = [{"role": "user", "content": "List the days of the week."}]
    body = {"model": MODEL, "messages": days, "max_tokens": 24, "temperature": 0.0, "stream": True}
    headers = {"x-request-id": "cut-short"}
    with HTTP.stream("POST", f"{live.url}/v1/chat/completions", json=body, headers=headers) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if '"content"' in line)
        # Another request for the server while the answer is being written: as a health probe.
        assert httpx.get(f"{server.base_url}/models", timeout=30).status_code == 200
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e.startswith("{")]
    assert chunks, events
    # What the server did: no chunk with a finish reason (so none with the gateway's `metrics`).
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks), chunks

    def row() -> dict[str, Any] | None:
        with engine.connect() as conn:
            found = conn.execute(
                sa.select(requests).where(requests.c.client_request_id == "cut-short")
            ).first()
        return None if found is None else dict(found._mapping)

    assert wait_for(lambda: row() is not None, 10)
    written = row()
    assert written is not None and written["finish_reason"] is None
    # An answer without an end is not a complete one: the client is told, as for any stream an
    # upstream breaks off (an error event, not [DONE]), and the row says so (the policy learns
    # from rows with outcome ok).
    assert events[-1] != "[DONE]" and "error" in chunks[-1], events[-3:]
    assert written["outcome"] == "error" and written["error_code"], written


def test_a_dead_pool_fails_over_to_the_other_and_unlogs_the_propensity(pools: Pools) -> None:
    set_rules(pools.live, exploration_rate=0.0)  # the rules alone: the speculative pool
    _, _, before = chat(pools.live, ECHO, max_tokens=4)
    assert before["arm"] == LOOKUP_ARM and before["propensity"] == 1.0

    # Just after a health probe, so that the next request is routed before the gateway could know.
    wait_for_scrape(pools.lookup)
    pools.lookup.kill()
    rid, text, route = chat(pools.live, ECHO, max_tokens=8)
    rid_s, text_s, route_s = chat_stream(pools.live, ECHO, max_tokens=8)

    # The policy chose the speculative pool, the plain one served: the outcome is not the chosen
    # arm's, so no propensity.
    assert route["backend"] == "plain" and route["arm"] == PLAIN_ARM, route
    assert route["chosen_arm"] == LOOKUP_ARM and "propensity" not in route
    assert route["candidates"] == ["lookup", "plain"]
    # Then the breaker is open: the policy chooses the plain pool itself, the only one left.
    assert route_s["backend"] == "plain" and route_s["arm"] == PLAIN_ARM, route_s
    assert "chosen_arm" not in route_s and route_s["propensity"] == 1.0
    assert text and text_s == text

    written = rows(pools, rid, rid_s)
    row, row_s = written[rid], written[rid_s]
    assert row["status"] == 200 and row["outcome"] == "ok" and row["backend"] == "plain"
    assert row["route"]["arm"] == PLAIN_ARM and row["route"]["chosen_arm"] == LOOKUP_ARM
    assert row["propensity"] is None
    assert row["attempts"] == 2  # one to the dead server, one to the plain one
    assert row_s["status"] == 200 and row_s["backend"] == "plain"
    assert row_s["route"]["arm"] == PLAIN_ARM and row_s["route"].get("chosen_arm") is None
    assert row_s["propensity"] == 1.0
    status = backend_status(pools.live)
    assert status["lookup"]["healthy"] is False and status["lookup"]["breaker"] == "open"
    assert status["plain"]["healthy"] is True
