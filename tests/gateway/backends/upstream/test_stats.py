"""capture(): timing and speculation fields from bodies shaped like vLLM, SGLang, llama.cpp and specgate.

Each fixture is written the way that server sends it today (field names checked against its source);
the older shapes the gateway still meets are kept beside them.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest

from specgate.engine.outputs import RequestStats, SpecStats
from specgate.engine.vocab import SpecStep
from specgate.gateway.backends.base import Observation
from specgate.gateway.backends.upstream.stats import MAX_COUNT, capture, spec_from_upstream
from specgate.gateway.protocol.openai_format import metrics_from_stats
from specgate.gateway.protocol.route import RouteDecision

USAGE: dict[str, Any] = {
    "prompt_tokens": 12,
    "completion_tokens": 32,
    "total_tokens": 44,
    "prompt_tokens_details": None,
}


def chat_body(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "chatcmpl-9f2c",
        "object": "chat.completion",
        "created": 1718000000,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "The sea is calm tonight.", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": dict(USAGE),
    }
    body.update(extra)
    return body


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "c", "object": "chat.completion.chunk", "choices": [choice], "usage": None, **extra}


def near(seconds: float) -> Any:
    """A span between two unix stamps: a float that large carries ~0.2 us of rounding."""
    return pytest.approx(seconds, abs=1e-6)


def observed(*bodies: dict[str, Any]) -> Observation:
    obs = Observation()
    for body in bodies:
        capture(copy.deepcopy(body), obs)
    return obs


# ---- vLLM today: `metrics` (PerRequestMetrics) with `speculative_decoding` -----------------------

# 10 verification steps of 3 drafts: [j] steps accepted exactly j of them (15 accepted in all).
VLLM_SPEC: dict[str, Any] = {
    "mean_acceptance_length": 2.5,
    "draft_acceptance_rate": 0.5,
    "acceptance_histogram": [2, 3, 3, 2],
    "num_spec_steps": 10,
    "num_accepted_draft_tokens": 15,
    "num_draft_tokens": 30,
    "num_spec_tokens": 3,
    "per_step_accepted": None,
    "per_step_drafted": None,
}
VLLM_METRICS: dict[str, Any] = {
    "time_to_first_token_ms": 41.5,  # from scheduling to the first token
    "generation_time_ms": 250.0,
    "queue_time_ms": 3.5,
    "mean_itl_ms": 10.0,
    "tokens_per_second": 89.19,
    "speculative_decoding": VLLM_SPEC,
}
VLLM_USAGE: dict[str, Any] = {"prompt_tokens": 12, "completion_tokens": 26, "total_tokens": 38}


def test_vllm_metrics_of_today_in_a_body() -> None:
    obs = observed(chat_body(usage=dict(VLLM_USAGE), metrics=VLLM_METRICS))
    assert obs.upstream == {"metrics": VLLM_METRICS}
    assert obs.backend_ttft == pytest.approx(0.045)  # its queue, then scheduling to first token
    assert obs.backend_tpot == pytest.approx(0.010)
    assert obs.queue_time == pytest.approx(0.0035)
    assert obs.spec_decoding == {
        "method": "upstream:vllm",
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 15,
        # position p was accepted by every step that accepted p drafts or more
        "num_accepted_tokens_per_pos": [8, 5, 2],
        "mean_acceptance_length": pytest.approx(2.5),
        "draft_acceptance_rate": pytest.approx(0.5),
    }


def test_vllm_metrics_of_today_arrive_on_the_stream_s_usage_chunk() -> None:
    tail = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": VLLM_USAGE}
    obs = observed(
        chunk({"role": "assistant", "content": ""}), chunk({"content": "The"}), chunk({}, "length")
    )
    assert obs.spec_decoding is None and obs.backend_ttft is None and obs.backend_tpot is None
    capture(copy.deepcopy({**tail, "metrics": VLLM_METRICS}), obs)
    assert obs.finish_reason == "length" and obs.completion_tokens == 26
    assert obs.backend_ttft == pytest.approx(0.045) and obs.backend_tpot == pytest.approx(0.010)
    assert obs.spec_decoding is not None and obs.spec_decoding["num_accepted_tokens_per_pos"] == [8, 5, 2]
    capture(chunk({}), obs)  # a later chunk without them erases nothing
    assert obs.backend_ttft == pytest.approx(0.045) and obs.spec_decoding["num_drafts"] == 10


def test_vllm_without_per_request_timing_still_reports_its_speculation() -> None:
    """Started without --enable-per-request-metrics, vLLM sends `metrics` for the speculation only."""
    metrics = {
        "time_to_first_token_ms": None,
        "generation_time_ms": None,
        "queue_time_ms": None,
        "mean_itl_ms": None,
        "tokens_per_second": None,
        "speculative_decoding": VLLM_SPEC,
    }
    obs = observed(chat_body(usage=dict(VLLM_USAGE), metrics=metrics))
    assert (obs.backend_ttft, obs.backend_tpot, obs.queue_time) == (None, None, None)
    assert obs.spec_decoding is not None and obs.spec_decoding["num_accepted_tokens"] == 15


@pytest.mark.parametrize(
    ("extra", "tpot"),
    [
        ({"mean_itl_ms": 10.0, "generation_time_ms": 500.0}, 0.010),  # its own mean wins
        ({"time_per_output_token_ms": 12.0}, 0.012),
        ({"inter_token_latency_ms": 11.0}, 0.011),
        ({"generation_time_ms": 250.0}, 0.010),  # 250 ms over the 25 tokens after the first
        ({"e2e_latency_ms": 295.0}, 0.010),  # (295 - 45) / 25: e2e less the time to first token
        ({}, None),
    ],
    ids=repr,
)
def test_vllm_time_per_output_token_from_what_it_reports(extra: dict[str, Any], tpot: float | None) -> None:
    metrics = {"time_to_first_token_ms": 41.5, "queue_time_ms": 3.5, **extra}
    obs = observed(chat_body(usage=dict(VLLM_USAGE), metrics=metrics))
    assert obs.backend_ttft == pytest.approx(0.045)
    assert obs.backend_tpot == (None if tpot is None else pytest.approx(tpot))


def test_vllm_time_to_first_token_without_its_queue_time_is_from_scheduling() -> None:
    obs = observed(chat_body(metrics={"time_to_first_token_ms": 41.5}))
    assert obs.backend_ttft == pytest.approx(0.0415) and obs.queue_time is None


@pytest.mark.parametrize(
    ("histogram", "counts", "per_pos"),
    [
        ([4], {}, []),  # one draft position, none accepted
        ([0, 0, 5], {}, [5, 5]),
        ([1, 0, 0, 2], {"num_spec_steps": 3, "num_accepted_draft_tokens": 6}, [2, 2, 2]),
        ([2, 3, 3, 2], {"num_spec_steps": 11}, None),  # it disagrees with the step count: dropped
        ([2, 3, 3, 2], {"num_accepted_draft_tokens": 16}, None),
        ([2, -3, 3, 2], {}, None),
        ([2, "3", 3, 2], {}, None),
        ([1] * 66, {}, None),  # more positions than any drafter proposes
        ([], {}, None),
        ("2,3,3,2", {}, None),
    ],
    ids=repr,
)
def test_vllm_acceptance_histogram_becomes_accepted_tokens_per_position(
    histogram: Any, counts: dict[str, Any], per_pos: list[int] | None
) -> None:
    spec = spec_from_upstream(
        {"metrics": {"speculative_decoding": {"acceptance_histogram": histogram, **counts}}}
    )
    got = None if spec is None else spec["num_accepted_tokens_per_pos"]
    assert got == per_pos
    if per_pos is not None:
        assert spec is not None
        assert spec["num_accepted_tokens"] == sum(per_pos)
        assert spec["num_drafts"] == sum(histogram)


# ---- vLLM before: RequestMetrics times and spec_token_acceptance_counts --------------------------

VLLM_OLD_METRICS: dict[str, Any] = {
    "arrival_time": 1718000000.01,
    "last_token_time": 1718000000.52,
    "first_scheduled_time": 1718000000.011,
    "first_token_time": 1718000000.05,
    "time_in_queue": 0.001,
    "finished_time": 1718000000.52,
    "scheduler_time": 0.004,
    "model_forward_time": None,
    "model_execute_time": None,
    # index 0 counts verification steps (the target's own token), index i the drafts accepted at i
    "spec_token_acceptance_counts": [14, 11, 8, 3],
}


def test_vllm_older_metrics_are_kept_raw_and_read() -> None:
    obs = observed(chat_body(metrics=VLLM_OLD_METRICS))
    assert obs.upstream == {"metrics": VLLM_OLD_METRICS}
    assert obs.prompt_tokens == 12 and obs.completion_tokens == 32
    assert obs.finish_reason == "length"
    assert obs.backend_ttft == near(0.04)  # first token less arrival
    assert obs.backend_tpot == near(0.47 / 31)  # first to last token over the 31 after it
    assert obs.queue_time == pytest.approx(0.001)
    spec = obs.spec_decoding
    assert spec is not None
    assert spec["method"] == "upstream:vllm"
    assert spec["num_drafts"] == 14
    assert spec["num_accepted_tokens"] == 22
    assert spec["num_accepted_tokens_per_pos"] == [11, 8, 3]
    assert spec["mean_acceptance_length"] == pytest.approx((22 + 14) / 14)
    assert spec["num_draft_tokens"] is None  # it did not say how many were drafted
    assert spec["draft_acceptance_rate"] is None


def test_vllm_older_metrics_without_speculation_give_no_spec() -> None:
    obs = observed(chat_body(metrics={**VLLM_OLD_METRICS, "spec_token_acceptance_counts": None}))
    assert obs.spec_decoding is None
    assert obs.upstream["metrics"]["time_in_queue"] == 0.001
    assert obs.backend_ttft == near(0.04)


def test_vllm_zero_steps_has_no_mean() -> None:
    spec = spec_from_upstream({"metrics": {"spec_token_acceptance_counts": [0, 0, 0]}})
    assert spec is not None
    assert spec["num_drafts"] == 0 and spec["num_accepted_tokens"] == 0
    assert spec["mean_acceptance_length"] is None


@pytest.mark.parametrize("counts", [[3, 4], [3, -1], [3, 1.5], [], [True, 1], [1] * 70], ids=repr)
def test_vllm_acceptance_counts_that_cannot_be_counts_are_ignored(counts: list[Any]) -> None:
    assert spec_from_upstream({"metrics": {"spec_token_acceptance_counts": counts}}) is None


def test_vllm_older_stream_metrics_arrive_before_the_usage_that_times_them() -> None:
    """A stream: finish + metrics on one chunk, the usage (which the time per token needs) after."""
    obs = observed(chunk({"role": "assistant", "content": ""}), chunk({"content": "The"}))
    assert obs.finish_reason is None and obs.spec_decoding is None and obs.completion_tokens is None
    capture(copy.deepcopy(chunk({}, "stop", metrics=VLLM_OLD_METRICS)), obs)
    assert obs.backend_ttft == near(0.04) and obs.backend_tpot is None  # no count yet
    capture({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": dict(USAGE)}, obs)
    assert obs.finish_reason == "stop"
    assert obs.completion_tokens == 32 and obs.prompt_tokens == 12
    assert obs.backend_tpot == near(0.47 / 31)
    assert obs.spec_decoding is not None and obs.spec_decoding["num_accepted_tokens"] == 22
    capture(chunk({}), obs)
    assert obs.finish_reason == "stop" and obs.completion_tokens == 32 and obs.spec_decoding is not None


def test_the_newer_vllm_shape_wins_where_one_body_carries_both() -> None:
    both = {**VLLM_OLD_METRICS, **VLLM_METRICS}
    obs = observed(chat_body(usage=dict(VLLM_USAGE), metrics=both))
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["num_drafts"] == 10 and obs.spec_decoding["num_draft_tokens"] == 30
    assert obs.backend_ttft == pytest.approx(0.045) and obs.backend_tpot == pytest.approx(0.010)
    assert obs.queue_time == pytest.approx(0.0035)


# ---- SGLang: `meta_info` -------------------------------------------------------------------------

# Native /generate with EAGLE (5 draft tokens: 4 guesses per step) and --enable-metrics, as its
# tokenizer manager's output processor and spec_decoding_meta fill it today.
SGLANG_META_NOW: dict[str, Any] = {
    "id": "4f1e2a",
    "finish_reason": {"type": "length", "length": 32},
    "prompt_tokens": 12,
    "weight_version": "default",
    "num_retractions": 0,
    "forward_entry_time": 1718000000.013,
    "prefill_finished_time": 1718000000.049,
    "queue_time": 0.002,
    "reasoning_tokens": 0,
    "completion_tokens": 32,
    "cached_tokens": 8,
    "e2e_latency": 0.41,
    "spec_accept_rate": 0.55,
    "spec_accept_length": 3.2,
    "spec_num_correct_drafts": 22,
    "spec_num_proposed_drafts": 40,
    "spec_verify_ct": 10,
    "spec_accepted_drafts": 22,
    "spec_proposed_drafts": 40,
    "spec_correct_drafts_histogram": [1, 2, 3, 2, 2],
    "spec_accept_histogram": [1, 2, 3, 2, 2],
    "request_received_ts": 1718000000.01,
    "api_server_dispatch_finish_ts": 1718000000.012,
    "response_sent_to_client_ts": 1718000000.421,
    "request_finished_ts": 1718000000.42,
    "decode_throughput": 31 / 0.37,
}
# The releases before: other names for the same counts, the tokenizer's own prefill stamp.
SGLANG_META_BEFORE: dict[str, Any] = {
    "id": "4f1e2a",
    "finish_reason": {"type": "length", "length": 32},
    "prompt_tokens": 12,
    "completion_tokens": 32,
    "cached_tokens": 0,
    "e2e_latency": 0.41,
    "spec_accept_rate": 0.55,
    "spec_accept_length": 3.2,
    "spec_accept_token_num": 22,
    "spec_draft_token_num": 40,
    "spec_verify_ct": 10,
    "request_received_ts": 1718000000.01,
    "prefill_finished_ts": 1718000000.05,
    "decode_finished_ts": 1718000000.42,
    "decode_throughput": 32 / 0.37,
}
# Older still: the steps and their mean length only.
SGLANG_META: dict[str, Any] = {
    "id": "4f1e",
    "finish_reason": {"type": "length", "length": 32},
    "prompt_tokens": 12,
    "completion_tokens": 32,
    "cached_tokens": 0,
    "e2e_latency": 0.41,
    "spec_verify_ct": 10,
    "spec_accept_length": 3.2,
    "spec_accept_rate": 0.55,
}


def test_sglang_meta_info_of_today() -> None:
    obs = observed({"text": "The sea is calm", "output_ids": [1, 2], "meta_info": SGLANG_META_NOW})
    assert obs.upstream == {"meta_info": SGLANG_META_NOW}
    assert (obs.prompt_tokens, obs.completion_tokens, obs.cached_tokens) == (12, 32, 8)  # no usage
    assert obs.backend_ttft == near(0.039)  # received to prefill finished
    assert obs.backend_tpot == pytest.approx(0.37 / 31)
    assert obs.queue_time == pytest.approx(0.002)
    assert obs.spec_decoding == {
        "method": "upstream:sglang",
        "num_drafts": 10,
        "num_draft_tokens": 40,
        "num_accepted_tokens": 22,
        "num_accepted_tokens_per_pos": [9, 7, 4, 2],
        "mean_acceptance_length": pytest.approx(3.2),
        "draft_acceptance_rate": pytest.approx(0.55),
    }


def test_sglang_meta_info_of_the_releases_before() -> None:
    obs = observed(chat_body(meta_info=SGLANG_META_BEFORE))
    assert obs.backend_ttft == near(0.04)
    assert obs.backend_tpot == pytest.approx(0.37 / 32)  # it divided by every token then
    spec = obs.spec_decoding
    assert spec is not None
    assert (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) == (10, 40, 22)
    assert spec["num_accepted_tokens_per_pos"] is None


def test_sglang_without_enable_metrics_says_nothing_of_its_first_token() -> None:
    obs = observed(chat_body(meta_info=SGLANG_META))
    assert (obs.backend_ttft, obs.backend_tpot, obs.queue_time) == (None, None, None)


def test_sglang_mean_length_only() -> None:
    obs = observed(chat_body(meta_info=SGLANG_META))
    assert obs.upstream == {"meta_info": SGLANG_META}
    spec = obs.spec_decoding
    assert spec is not None
    assert spec["method"] == "upstream:sglang"
    assert spec["num_drafts"] == 10
    assert spec["num_accepted_tokens"] == 22  # (3.2 - 1) * 10
    assert spec["mean_acceptance_length"] == pytest.approx(3.2)
    assert spec["draft_acceptance_rate"] == pytest.approx(0.55)


def test_sglang_meta_info_inside_a_choice_and_without_a_rate() -> None:
    meta = {k: v for k, v in SGLANG_META.items() if k != "spec_accept_rate"}
    body = chat_body()
    body["choices"][0]["meta_info"] = meta
    obs = observed(body)
    assert obs.upstream == {"meta_info": meta}
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["num_accepted_tokens"] == 22
    assert obs.spec_decoding["draft_acceptance_rate"] is None


def test_sglang_without_speculation_gives_no_spec() -> None:
    meta = {k: v for k, v in SGLANG_META_NOW.items() if not k.startswith("spec_")}
    obs = observed(chat_body(meta_info=meta))
    assert obs.spec_decoding is None and obs.upstream == {"meta_info": meta}
    assert obs.backend_ttft == near(0.039)


def test_sglang_with_no_verification_step_accepted_nothing() -> None:
    # It writes a rate of 0.0 and a length of 0 before it knows there was any step.
    spec = spec_from_upstream(
        {"meta_info": {"spec_verify_ct": 0, "spec_accept_length": 0, "spec_accept_rate": 0.0}}
    )
    assert spec is not None
    assert (spec["num_drafts"], spec["num_accepted_tokens"], spec["mean_acceptance_length"]) == (0, 0, None)
    assert spec["draft_acceptance_rate"] is None


def test_usage_wins_over_the_counts_in_meta_info() -> None:
    usage = {"prompt_tokens": 13, "completion_tokens": 30, "prompt_tokens_details": {"cached_tokens": 4}}
    for order in ((usage, SGLANG_META_NOW), (SGLANG_META_NOW, usage)):
        obs = Observation()
        for part in order:
            capture(copy.deepcopy({"usage": part} if part is usage else {"meta_info": part}), obs)
        assert (obs.prompt_tokens, obs.completion_tokens, obs.cached_tokens) == (13, 30, 4)


# ---- llama.cpp: `timings` ------------------------------------------------------------------------

LLAMA_TIMINGS: dict[str, Any] = {
    "cache_n": 5,
    "prompt_n": 7,
    "prompt_ms": 30.1,
    "prompt_per_token_ms": 4.3,
    "prompt_per_second": 232.56,
    "predicted_n": 32,
    "predicted_ms": 387.5,
    "predicted_per_token_ms": 12.5,
    "predicted_per_second": 80.0,
    "draft_n": 40,
    "draft_n_accepted": 26,
}


def test_llama_cpp_timings_with_a_draft_model() -> None:
    obs = observed(chat_body(timings=LLAMA_TIMINGS))
    assert obs.upstream == {"timings": LLAMA_TIMINGS}
    assert obs.backend_ttft == pytest.approx(0.0301)  # its prefill
    assert obs.backend_tpot == pytest.approx(0.0125)
    assert obs.cached_tokens == 5  # usage did not say; its cache did
    spec = obs.spec_decoding
    assert spec is not None
    assert spec["method"] == "upstream:llama.cpp"
    assert spec["num_draft_tokens"] == 40
    assert spec["num_accepted_tokens"] == 26
    assert spec["draft_acceptance_rate"] == pytest.approx(0.65)
    assert spec["num_drafts"] is None  # llama.cpp does not count verification steps
    assert spec["mean_acceptance_length"] is None


def test_llama_cpp_timings_without_drafting() -> None:
    timings = {k: v for k, v in LLAMA_TIMINGS.items() if not k.startswith("draft_")}
    obs = observed({**chat_body(), "timings": timings})
    assert obs.spec_decoding is None
    assert obs.upstream == {"timings": timings}
    assert obs.backend_ttft == pytest.approx(0.0301)


def test_llama_cpp_time_per_token_without_its_own_per_token_figure() -> None:
    timings = {**LLAMA_TIMINGS, "predicted_per_token_ms": 0.0}  # 0: not measured yet
    obs = observed(chat_body(timings=timings))
    assert obs.backend_tpot == pytest.approx(0.3875 / 31)  # the first token comes with the prompt


def test_llama_cpp_nothing_measured_yet_is_no_measurement() -> None:
    timings = {"cache_n": -1, "prompt_n": -1, "prompt_ms": 0.0, "predicted_n": -1, "predicted_ms": 0.0}
    obs = observed(chat_body(timings=timings))
    assert (obs.backend_ttft, obs.backend_tpot, obs.cached_tokens) == (None, None, None)


@pytest.mark.parametrize(
    ("details", "cache_n", "expected"),
    [
        ({"cached_tokens": 3}, 5, 3),  # usage said: it wins
        ({"cached_tokens": None}, 5, 5),
        (None, 5, 5),
        (None, 13, None),  # more than the 12 prompt tokens
        (None, -1, None),
        (None, True, None),
    ],
    ids=repr,
)
def test_cached_tokens_from_llama_cpp_only_where_usage_is_silent(
    details: Any, cache_n: Any, expected: int | None
) -> None:
    obs = observed(chat_body(usage={**USAGE, "prompt_tokens_details": details}, timings={"cache_n": cache_n}))
    assert obs.cached_tokens == expected


def test_llama_cpp_stream_cached_tokens_checked_against_the_prompt_that_comes_later() -> None:
    obs = observed(chunk({}, "stop", timings={**LLAMA_TIMINGS, "cache_n": 20}))
    assert obs.cached_tokens == 20  # no prompt count to check it against yet
    capture({"choices": [], "usage": dict(USAGE)}, obs)
    assert obs.cached_tokens is None  # 20 cached of a 12-token prompt


# ---- another specgate --------------------------------------------------------------------------


SPECGATE_USAGE: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def specgate_stats() -> RequestStats:
    stats = RequestStats(arrival_ts=100.0, num_prompt_tokens=5, num_output_tokens=12)
    stats.scheduled_ts, stats.first_token_ts = 100.002, 100.030
    stats.last_token_ts = stats.finished_ts = 100.140
    stats.spec = SpecStats("ngram")
    for drafted, accepted in [(4, 2), (4, 4), (4, 0)]:
        stats.spec.record(SpecStep(drafted, accepted, 0, 0.0, drafted))
    return stats


def test_another_specgate_s_spec_decoding_comes_through_unchanged() -> None:
    stats = specgate_stats()
    inner = metrics_from_stats(stats, RouteDecision("m", ["embedded"], None))
    obs = observed(chat_body(usage=dict(SPECGATE_USAGE), metrics=inner))
    spec = obs.spec_decoding
    assert spec is not None
    assert spec["method"] == "upstream:ngram"
    for key, value in inner["spec_decoding"].items():
        if key != "method":
            assert spec[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert obs.backend_ttft == pytest.approx(stats.ttft)
    assert obs.backend_tpot == pytest.approx(stats.tpot)
    assert obs.queue_time == pytest.approx(stats.queue_time)


def test_another_specgate_without_speculation() -> None:
    stats = specgate_stats()
    stats.spec = None
    inner = metrics_from_stats(stats, None)
    obs = observed(chat_body(usage=dict(SPECGATE_USAGE), metrics=inner))
    assert obs.spec_decoding is None
    assert obs.backend_ttft == pytest.approx(0.030) and obs.backend_tpot == pytest.approx(0.010)
    stats.num_forced_draft_tokens = 3  # a grammar forced drafts: those still come through
    obs = observed(chat_body(usage=dict(SPECGATE_USAGE), metrics=metrics_from_stats(stats, None)))
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["method"] is None and obs.spec_decoding["num_forced_draft_tokens"] == 3


def test_a_specgate_in_front_of_vllm_passes_on_what_vllm_measured() -> None:
    """What a specgate answers when an external backend served it (http/serving.py)."""
    spec = {
        "method": "upstream:vllm",
        "num_drafts": 10,
        "num_draft_tokens": 30,
        "num_accepted_tokens": 15,
        "num_accepted_tokens_per_pos": [8, 5, 2],
        "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.5,
    }
    metrics = {"route": {"backend": "vllm-a"}, "spec_decoding": spec, "upstream": {"metrics": VLLM_METRICS}}
    obs = observed(chat_body(usage=dict(VLLM_USAGE), metrics=metrics))
    assert obs.spec_decoding == spec  # not marked a second time
    assert obs.backend_ttft == pytest.approx(0.045) and obs.backend_tpot == pytest.approx(0.010)


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("eagle", "upstream:eagle"),
        ("upstream:sglang", "upstream:sglang"),
        ("x" * 49, "upstream:specgate"),
        ("", "upstream:specgate"),
        ("bad\nname", "upstream:specgate"),
        (7, "upstream:specgate"),
    ],
    ids=repr,
)
def test_an_inner_method_is_marked_as_an_upstream_s(method: Any, expected: str) -> None:
    spec = spec_from_upstream({"metrics": {"spec_decoding": {"method": method, "num_drafts": 3}}})
    assert spec is not None and spec["method"] == expected


def test_another_specgate_s_counters_are_checked_one_by_one() -> None:
    sd = {
        "method": "suffix",
        "num_drafts": 3,
        "num_draft_tokens": -4,
        "num_accepted_tokens": 6,
        "num_accepted_tokens_per_pos": [3, "2", 1],
        "mean_acceptance_length": float("inf"),
        "draft_acceptance_rate": 1.5,
        "num_tree_drafts": True,
        "mean_draft_nodes": 4.0,
        "unknown_counter": 5,
    }
    spec = spec_from_upstream({"metrics": {"spec_decoding": sd}})
    assert spec is not None
    assert spec["num_drafts"] == 3 and spec["num_accepted_tokens"] == 6
    assert spec["num_draft_tokens"] is None and spec["num_accepted_tokens_per_pos"] is None
    assert spec["mean_acceptance_length"] == pytest.approx(3.0)  # (6 + 3) / 3, from its counts
    assert spec["draft_acceptance_rate"] is None and "num_tree_drafts" not in spec
    assert spec["mean_draft_nodes"] == 4.0
    assert "unknown_counter" not in spec


# ---- untrusted numbers ---------------------------------------------------------------------------

BAD_NUMBERS = [-1, -0.5, True, "12", None, [3], {"v": 3}, math.nan, math.inf, 2**31, 2**70, 1e308]


@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("metrics", "time_to_first_token_ms"),
        ("metrics", "mean_itl_ms"),
        ("metrics", "queue_time_ms"),
        ("metrics", "first_token_time"),
        ("meta_info", "decode_throughput"),
        ("meta_info", "request_received_ts"),
        ("timings", "prompt_ms"),
        ("timings", "predicted_per_token_ms"),
    ],
)
def test_a_timing_that_cannot_be_true_is_ignored_alone(where: str, key: str, bad: Any) -> None:
    fixtures = {
        "metrics": {**VLLM_OLD_METRICS, **VLLM_METRICS},
        "meta_info": SGLANG_META_NOW,
        "timings": LLAMA_TIMINGS,
    }
    good = observed(chat_body(usage=dict(VLLM_USAGE), **{where: fixtures[where]}))
    raw = {**fixtures[where], key: bad}
    obs = observed(chat_body(usage=dict(VLLM_USAGE), **{where: raw}))
    assert obs.spec_decoding == good.spec_decoding  # the rest stands
    for got in (obs.backend_ttft, obs.backend_tpot, obs.queue_time):
        assert got is None or (isinstance(got, float) and 0 <= got <= 86_400)


@pytest.mark.parametrize("bad", BAD_NUMBERS, ids=repr)
@pytest.mark.parametrize(
    ("where", "key", "column"),
    [
        ("speculative_decoding", "num_spec_steps", "num_drafts"),
        ("speculative_decoding", "num_draft_tokens", "num_draft_tokens"),
        ("speculative_decoding", "num_accepted_draft_tokens", "num_accepted_tokens"),
        ("meta_info", "spec_num_proposed_drafts", "num_draft_tokens"),
        ("timings", "draft_n_accepted", "num_accepted_tokens"),
    ],
)
def test_a_count_that_cannot_be_true_is_ignored_alone(where: str, key: str, column: str, bad: Any) -> None:
    if where == "speculative_decoding":
        sd = {k: v for k, v in VLLM_SPEC.items() if k != "acceptance_histogram"}
        raw: dict[str, Any] = {"metrics": {"speculative_decoding": {**sd, key: bad}}}
    elif where == "meta_info":
        raw = {"meta_info": {**SGLANG_META_BEFORE, key: bad, "spec_draft_token_num": None}}
    else:
        raw = {"timings": {**LLAMA_TIMINGS, key: bad}}
    spec = spec_from_upstream(raw)
    assert spec is not None and spec[column] is None
    assert spec["draft_acceptance_rate"] is None or 0 <= spec["draft_acceptance_rate"] <= 1


@pytest.mark.parametrize(
    ("where", "raw"),
    [
        (
            "vLLM e2e",
            {"metrics": {"time_to_first_token_ms": 500.0, "e2e_latency_ms": 400.0, "mean_itl_ms": 5.0}},
        ),
        (
            "vLLM decode",
            {"metrics": {"time_to_first_token_ms": 10.0, "e2e_latency_ms": 100.0, "mean_itl_ms": 50.0}},
        ),
        (
            "vLLM queue",
            {"metrics": {"queue_time_ms": 600.0, "time_to_first_token_ms": 1.0, "e2e_latency_ms": 100.0}},
        ),
        ("RequestMetrics", {"metrics": {**VLLM_OLD_METRICS, "finished_time": 1718000000.03}}),
        ("SGLang", {"meta_info": {**SGLANG_META_NOW, "e2e_latency": 0.02}}),
    ],
)
def test_timings_that_contradict_each_other_are_dropped(where: str, raw: dict[str, Any]) -> None:
    obs = observed(chat_body(**raw))
    assert (obs.backend_ttft, obs.backend_tpot, obs.queue_time) == (None, None, None), where


def test_a_day_is_the_longest_duration_believed() -> None:
    obs = observed(chat_body(metrics={"time_to_first_token_ms": 86_400_000.0, "mean_itl_ms": 86_400_001.0}))
    assert obs.backend_ttft == pytest.approx(86_400.0) and obs.backend_tpot is None
    # A day from scheduling and a queue before it: no longer a request's time to first token.
    obs = observed(chat_body(metrics={"time_to_first_token_ms": 86_400_000.0, "queue_time_ms": 5.0}))
    assert obs.backend_ttft is None and obs.queue_time == pytest.approx(0.005)


def _anything(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 7, 2**31 - 1, 2**31, 2**63, 2**200, -(2**200)])
    if kind == 3:
        return rng.choice([0.0, -0.0, 0.5, -3.5, 1e-320, 1e300, math.inf, -math.inf, math.nan])
    if kind in (4, 5, 6):
        return rng.uniform(0, 2e9) if kind == 4 else rng.randrange(0, 100)
    if kind in (7, 8):
        return rng.choice(["", "12", "upstream:x", "nan", "\x00", "é" * 80])
    if kind in (9, 10):
        return [_anything(rng, depth + 1) for _ in range(rng.randrange(0, 80 if kind == 10 else 5))]
    return {str(rng.randrange(5)): _anything(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def test_any_value_in_any_field_never_raises_and_never_reaches_obs_out_of_range() -> None:
    rng = random.Random(1234)
    shapes: list[tuple[str, dict[str, Any]]] = [
        ("metrics", {**VLLM_OLD_METRICS, **VLLM_METRICS}),
        ("metrics", {"speculative_decoding": VLLM_SPEC}),
        ("metrics", metrics_from_stats(specgate_stats(), None)),
        ("meta_info", SGLANG_META_NOW),
        ("meta_info", SGLANG_META_BEFORE),
        ("timings", LLAMA_TIMINGS),
    ]
    for _ in range(1500):
        where, base = rng.choice(shapes)
        raw = copy.deepcopy(base)
        nested = [v for v in raw.values() if isinstance(v, dict)]  # speculative_decoding, spec_decoding
        inner = rng.choice(nested) if nested and rng.random() < 0.5 else raw
        for key in rng.sample(sorted(inner), k=min(len(inner), rng.randrange(1, 4))):
            inner[key] = _anything(rng)
        usage = {"prompt_tokens": _anything(rng), "completion_tokens": _anything(rng)}
        obs = Observation()
        capture({"choices": [], "usage": usage, where: raw}, obs)
        for value in (obs.backend_ttft, obs.backend_tpot, obs.queue_time):
            assert value is None or (type(value) is float and 0 <= value <= 86_400), (where, raw)
        for value in (obs.prompt_tokens, obs.completion_tokens, obs.cached_tokens):
            assert value is None or (type(value) is int and 0 <= value <= MAX_COUNT)
        for key, value in (obs.spec_decoding or {}).items():
            if key == "method":
                assert value is None or (isinstance(value, str) and len(value) <= 64)
            elif key == "num_accepted_tokens_per_pos":
                assert value is None or all(type(c) is int and 0 <= c <= MAX_COUNT for c in value)
            else:
                assert value is None or (type(value) in (int, float) and 0 <= value <= MAX_COUNT + 1), key
                assert not (key == "draft_acceptance_rate" and value is not None and value > 1)


# ---- bodies with none of it ----------------------------------------------------------------------


def test_plain_openai_body_leaves_no_upstream_stats() -> None:
    obs = observed(chat_body())
    assert obs.upstream == {} and obs.spec_decoding is None
    assert (obs.backend_ttft, obs.backend_tpot, obs.queue_time) == (None, None, None)
    assert (obs.prompt_tokens, obs.completion_tokens, obs.finish_reason) == (12, 32, "length")


def test_odd_shapes_are_ignored() -> None:
    obs = Observation()
    capture({"choices": None, "usage": None, "metrics": "n/a", "timings": [1, 2]}, obs)
    capture({"choices": ["not a dict", {"finish_reason": {"type": "stop"}}], "meta_info": None}, obs)
    assert obs.upstream == {} and obs.spec_decoding is None and obs.prompt_tokens is None
    assert obs.finish_reason is None  # only a string is a finish reason


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        ({"cached_tokens": 8}, 8),  # vLLM / OpenAI
        ({"cached_tokens": 0}, 0),
        ({"cached_tokens": None}, None),
        ({}, None),
        (None, None),  # vLLM without --enable-prompt-tokens-details
        ({"cached_tokens": -1}, None),
        ({"cached_tokens": True}, None),
        ({"cached_tokens": "8"}, None),
        ({"cached_tokens": 2**40}, None),
        ("8", None),
    ],
    ids=repr,
)
def test_cached_tokens_are_read_from_prompt_tokens_details(details: Any, expected: int | None) -> None:
    obs = observed(chat_body(usage={**USAGE, "prompt_tokens_details": details}))
    assert obs.cached_tokens == expected
    assert obs.prompt_tokens == 12  # the rest of the usage is read either way


def test_a_stream_reports_cached_tokens_in_its_usage_chunk() -> None:
    obs = observed({"choices": [{"index": 0, "delta": {"content": "x"}}]})
    assert obs.cached_tokens is None
    capture({"choices": [], "usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}}}, obs)
    assert obs.cached_tokens == 4
