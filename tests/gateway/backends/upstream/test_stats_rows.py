"""Each backend's own per-request timings and speculation, from its answer to the telemetry row.

A live gateway in front of the scripted upstream (tests/gateway/fake_upstream.py) writes its rows
to a SQLite file. Each test scripts one answer carrying the fields as that server sends them today
(`Reply(extra=...)` lands in the body, or in a stream's last chunk) and reads back the row the
writer stored: a non-streamed answer's time to first token and per output token are the backend's
own (or NULL where it measured none: never the whole request), a stream's first token is timed by
the gateway.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from specgate.engine.outputs import RequestStats, SpecStats
from specgate.engine.vocab import SpecStep
from specgate.gateway.protocol.openai_format import metrics_from_stats
from tests.gateway.backends.upstream.test_stats import LLAMA_TIMINGS as STATS_LLAMA_TIMINGS
from tests.gateway.backends.upstream.test_stats import SGLANG_META_NOW, VLLM_METRICS, VLLM_OLD_METRICS
from tests.gateway.fake_upstream import HTTP, PROMPT_TOKENS, FakeUpstream, Reply, backend, running_gateway
from tests.gateway.live import LiveGateway, stored_row

pytestmark = pytest.mark.timeout(90)

PUBLIC, UPSTREAM = "public-model", "upstream-model"


class Served:
    def __init__(self, live: LiveGateway, fake: FakeUpstream, db: sa.Engine) -> None:
        self.live, self.fake, self.db = live, fake, db

    def row(self, reply: Reply, stream: bool) -> dict[str, Any]:
        """The stored row of one chat request the upstream answers with `reply`."""
        self.fake.reset()
        self.fake.script(reply)
        rid = f"stats-row-{uuid.uuid4().hex}"
        body = {"model": PUBLIC, "messages": [{"role": "user", "content": "Say hello"}], "stream": stream}
        r = HTTP.post(f"{self.live.url}/v1/chat/completions", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert not stream or r.text.rstrip().endswith("data: [DONE]"), r.text
        return stored_row(self.db, rid)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    url = f"sqlite:///{tmp_path_factory.mktemp('stats_rows')}/telemetry.db"
    telemetry = {"url": url, "auto_upgrade": True, "flush_interval": 0.02}
    with (
        FakeUpstream(models=(UPSTREAM,)) as fake,
        running_gateway(backend("up", fake, models={PUBLIC: UPSTREAM}), telemetry=telemetry) as live,
    ):
        db = sa.create_engine(url)
        try:
            yield Served(live, fake, db)
        finally:
            db.dispose()


def words(n: int) -> str:
    """An answer of `n` words: the fake counts (and streams) one token per word."""
    return " ".join(["tok"] * n)


def assert_backend_ttft(row: dict[str, Any], stream: bool, backend_ms: float) -> None:
    assert row["ttft_ms"] is not None and row["e2e_ms"] is not None
    if stream:
        # The gateway saw the first token itself: within the request, not what the backend said.
        assert 0 < row["ttft_ms"] <= row["e2e_ms"]
    else:
        # Sent at or after arrival: the backend's own figure plus the gateway's time before sending,
        # but never later than the answer's arrival (the fake answers at once, so a claim longer
        # than the whole call is cut to it).
        assert row["ttft_ms"] <= row["e2e_ms"]
        assert row["ttft_ms"] >= min(backend_ms, row["e2e_ms"] / 2)


def assert_backend_tpot(row: dict[str, Any], stream: bool, backend_ms: float, **approx: Any) -> None:
    if stream:
        # The gateway measured the stream's tokens itself: its TPOT is the gateway's, not the claim.
        assert row["tpot_ms"] is not None and row["tpot_ms"] != pytest.approx(backend_ms, **approx)
    else:
        assert row["tpot_ms"] == pytest.approx(backend_ms, **approx)


def spec_columns(row: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "spec_method",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_accepted_tokens_per_pos",
        "mean_acceptance_length",
        "draft_acceptance_rate",
    )
    return {k: row[k] for k in keys}


# ---- each backend as it answers today ------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_of_today(served: Served, stream: bool) -> None:
    reply = Reply.ok(
        words(26), extra={"metrics": VLLM_METRICS}, usage={"prompt_tokens_details": {"cached_tokens": 3}}
    )
    row = served.row(reply, stream)
    assert_backend_ttft(row, stream, 45.0)  # its queue, then scheduling to first token
    assert_backend_tpot(row, stream, 10.0)
    assert row["queue_time_ms"] == pytest.approx(3.5)
    assert row["cached_tokens"] == 3 and row["completion_tokens"] == 26
    assert spec_columns(row) == {
        "spec_method": "upstream:vllm",
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 15,
        "num_accepted_tokens_per_pos": [8, 5, 2],
        "mean_acceptance_length": pytest.approx(2.5),
        "draft_acceptance_rate": pytest.approx(0.5),
    }


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_request_metrics_of_before(served: Served, stream: bool) -> None:
    row = served.row(Reply.ok(words(32), extra={"metrics": VLLM_OLD_METRICS}), stream)
    assert_backend_ttft(row, stream, 40.0)
    assert_backend_tpot(row, stream, 470.0 / 31, abs=1e-3)
    assert row["queue_time_ms"] == pytest.approx(1.0, abs=1e-3)
    assert row["cached_tokens"] is None
    assert spec_columns(row) == {
        "spec_method": "upstream:vllm",
        "num_drafts": 14,
        "num_draft_tokens": None,
        "num_accepted_tokens": 22,
        "num_accepted_tokens_per_pos": [11, 8, 3],
        "mean_acceptance_length": pytest.approx(36 / 14),
        "draft_acceptance_rate": None,
    }


# The same answer as test_stats' fixture, for this prompt (the fake upstream's prompt tokens).
SGLANG_META = {**SGLANG_META_NOW, "prompt_tokens": PROMPT_TOKENS, "cached_tokens": 4}


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_meta_info(served: Served, stream: bool) -> None:
    row = served.row(Reply.ok(words(32), extra={"meta_info": SGLANG_META}), stream)
    assert_backend_ttft(row, stream, 39.0)  # received to prefill finished
    assert_backend_tpot(row, stream, 370.0 / 31)
    assert row["queue_time_ms"] == pytest.approx(2.0)
    assert row["cached_tokens"] == 4  # usage did not say; its meta_info did
    assert spec_columns(row) == {
        "spec_method": "upstream:sglang",
        "num_drafts": 10,
        "num_draft_tokens": 40,
        "num_accepted_tokens": 22,
        "num_accepted_tokens_per_pos": [9, 7, 4, 2],
        "mean_acceptance_length": pytest.approx(3.2),
        "draft_acceptance_rate": pytest.approx(0.55),
    }


# test_stats' llama-server answer, for a 7-token prompt of which 5 were cached.
LLAMA_TIMINGS = {
    **STATS_LLAMA_TIMINGS,
    "prompt_n": 2,
    "prompt_per_token_ms": 15.05,
    "prompt_per_second": 66.45,
}


@pytest.mark.parametrize("stream", [False, True])
def test_llama_cpp_timings(served: Served, stream: bool) -> None:
    row = served.row(Reply.ok(words(32), extra={"timings": LLAMA_TIMINGS}), stream)
    assert_backend_ttft(row, stream, 30.1)  # its prefill
    assert_backend_tpot(row, stream, 12.5)
    assert row["queue_time_ms"] is None
    assert row["cached_tokens"] == 5
    assert spec_columns(row) == {
        "spec_method": "upstream:llama.cpp",
        "num_drafts": None,  # it does not count verification steps
        "num_draft_tokens": 40,
        "num_accepted_tokens": 26,
        "num_accepted_tokens_per_pos": None,
        "mean_acceptance_length": None,
        "draft_acceptance_rate": pytest.approx(0.65),
    }


def specgate_metrics() -> dict[str, Any]:
    """What another specgate's embedded engine answers: its `metrics`, built by the same code."""
    stats = RequestStats(arrival_ts=100.0, num_prompt_tokens=PROMPT_TOKENS, num_output_tokens=12)
    stats.scheduled_ts, stats.first_token_ts = 100.002, 100.030
    stats.last_token_ts = stats.finished_ts = 100.140
    stats.spec = SpecStats("ngram")
    for drafted, accepted in [(4, 2), (4, 4), (4, 0)]:
        stats.spec.record(SpecStep(drafted, accepted, 0, 0.0, drafted))
    return metrics_from_stats(stats, None)


@pytest.mark.parametrize("stream", [False, True])
def test_another_specgate(served: Served, stream: bool) -> None:
    row = served.row(Reply.ok(words(12), extra={"metrics": specgate_metrics()}), stream)
    assert_backend_ttft(row, stream, 30.0)
    assert_backend_tpot(row, stream, 10.0)
    assert row["queue_time_ms"] == pytest.approx(2.0)
    assert spec_columns(row) == {
        "spec_method": "upstream:ngram",  # its own method, marked as an upstream's
        "num_drafts": 3,
        "num_draft_tokens": 12,
        "num_accepted_tokens": 6,
        "num_accepted_tokens_per_pos": [2, 2, 1, 1],
        "mean_acceptance_length": pytest.approx(3.0),
        "draft_acceptance_rate": pytest.approx(0.5),
    }


# ---- without timings of its own ------------------------------------------------------------------


def test_a_plain_answer_leaves_its_first_token_and_pace_unknown(served: Served) -> None:
    row = served.row(Reply.ok(words(5)), stream=False)
    assert row["ttft_ms"] is None and row["first_token_time"] is None  # not 0, not the whole request
    assert row["tpot_ms"] is None
    assert row["e2e_ms"] is not None and row["completion_tokens"] == 5
    assert row["queue_time_ms"] is None and row["spec_method"] is None and row["num_drafts"] is None


def test_a_plain_stream_is_timed_by_the_gateway(served: Served) -> None:
    row = served.row(Reply.ok(words(5)), stream=True)
    assert 0 < row["ttft_ms"] <= row["e2e_ms"]
    assert row["tpot_ms"] is not None and row["tpot_ms"] >= 0


def test_vllm_speculation_without_per_request_timing(served: Served) -> None:
    """vLLM without --enable-per-request-metrics still sends its speculation, and no times."""
    metrics = {
        **{k: None for k in VLLM_METRICS},
        "speculative_decoding": VLLM_METRICS["speculative_decoding"],
    }
    row = served.row(Reply.ok(words(26), extra={"metrics": metrics}), stream=False)
    assert (row["ttft_ms"], row["tpot_ms"], row["queue_time_ms"]) == (None, None, None)
    assert row["num_accepted_tokens"] == 15 and row["num_accepted_tokens_per_pos"] == [8, 5, 2]


def test_a_stream_keeps_its_own_first_token_whatever_the_backend_claims(served: Served) -> None:
    claims = {"time_to_first_token_ms": 30_000.0, "queue_time_ms": 0.0, "mean_itl_ms": 10.0}
    row = served.row(Reply.ok(words(5), extra={"metrics": claims}), stream=True)
    assert 0 < row["ttft_ms"] <= row["e2e_ms"] < 30_000.0


def test_hostile_numbers_never_reach_the_row(served: Served) -> None:
    metrics = {
        "time_to_first_token_ms": -5.0,
        "queue_time_ms": True,
        "mean_itl_ms": 1e30,
        "generation_time_ms": "250",
        "speculative_decoding": {
            "num_spec_steps": 2**40,
            "num_draft_tokens": -3,
            "num_accepted_draft_tokens": 15,
            "acceptance_histogram": [2, 3, "3", 2],
        },
    }
    timings = {"cache_n": 2**31, "prompt_ms": -1.0, "predicted_per_token_ms": 86_400_001.0}
    row = served.row(Reply.ok(words(5), extra={"metrics": metrics, "timings": timings}), stream=False)
    assert (row["ttft_ms"], row["tpot_ms"], row["queue_time_ms"], row["cached_tokens"]) == (None,) * 4
    assert spec_columns(row) == {
        "spec_method": "upstream:vllm",
        "num_drafts": None,
        "num_draft_tokens": None,
        "num_accepted_tokens": 15,
        "num_accepted_tokens_per_pos": None,
        "mean_acceptance_length": None,
        "draft_acceptance_rate": None,
    }
