"""capture(): timing and speculation fields from bodies shaped like vLLM, SGLang, llama.cpp and specgate."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from specgate.engine.outputs import RequestStats, SpecStats
from specgate.gateway.backends.base import Observation
from specgate.gateway.backends.upstream.stats import capture, spec_from_upstream
from specgate.gateway.protocol.openai_format import metrics_from_stats
from specgate.gateway.protocol.route import RouteDecision

USAGE = {"prompt_tokens": 12, "completion_tokens": 32, "total_tokens": 44, "prompt_tokens_details": None}


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


VLLM_METRICS = {
    "arrival_time": 1718000000.01,
    "last_token_time": 1718000000.52,
    "first_scheduled_time": 1718000000.011,
    "first_token_time": 1718000000.05,
    "time_in_queue": 0.001,
    "finished_time": 1718000000.52,
    "scheduler_time": 0.004,
    "model_forward_time": None,
    "model_execute_time": None,
    # vLLM: index 0 counts verification steps (the target's own token), index i the drafts
    # accepted at position i.
    "spec_token_acceptance_counts": [14, 11, 8, 3],
}


def test_vllm_metrics_are_kept_raw_and_read_as_speculation() -> None:
    obs = Observation()
    capture(chat_body(metrics=copy.deepcopy(VLLM_METRICS)), obs)
    assert obs.upstream == {"metrics": VLLM_METRICS}
    assert obs.prompt_tokens == 12 and obs.completion_tokens == 32
    assert obs.finish_reason == "length"
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["method"] == "upstream:vllm"
    assert obs.spec_decoding["num_drafts"] == 14
    assert obs.spec_decoding["num_accepted_tokens"] == 22
    assert obs.spec_decoding["num_accepted_tokens_per_pos"] == [11, 8, 3]
    assert obs.spec_decoding["mean_acceptance_length"] == pytest.approx((22 + 14) / 14)
    assert obs.spec_decoding["num_draft_tokens"] is None  # vLLM does not say how many were drafted
    assert obs.spec_decoding["draft_acceptance_rate"] is None


def test_vllm_without_speculation_gives_no_spec() -> None:
    obs = Observation()
    capture(chat_body(metrics={**VLLM_METRICS, "spec_token_acceptance_counts": None}), obs)
    assert obs.spec_decoding is None
    assert obs.upstream["metrics"]["time_in_queue"] == 0.001


def test_vllm_zero_steps_has_no_mean() -> None:
    spec = spec_from_upstream({"metrics": {"spec_token_acceptance_counts": [0, 0, 0]}})
    assert spec is not None
    assert spec["num_drafts"] == 0 and spec["num_accepted_tokens"] == 0
    assert spec["mean_acceptance_length"] is None


def test_vllm_stream_metrics_arrive_with_the_last_chunk() -> None:
    """A stream: usage null on content chunks, finish + metrics on the last, then the usage chunk."""

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": "c", "object": "chat.completion.chunk", "choices": [choice], "usage": None, **extra}

    obs = Observation()
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "The"}),
        chunk({"content": " sea"}),
        chunk({}, "stop", metrics=copy.deepcopy(VLLM_METRICS)),
        {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": dict(USAGE)},
    ]
    capture(chunks[0], obs)
    capture(chunks[1], obs)
    assert obs.finish_reason is None and obs.spec_decoding is None and obs.completion_tokens is None
    for c in chunks[2:]:
        capture(c, obs)
    assert obs.finish_reason == "stop"
    assert obs.completion_tokens == 32 and obs.prompt_tokens == 12
    assert obs.spec_decoding is not None and obs.spec_decoding["num_accepted_tokens"] == 22
    # A later chunk without those fields does not erase them.
    capture(chunk({}), obs)
    assert obs.finish_reason == "stop" and obs.completion_tokens == 32 and obs.spec_decoding is not None


SGLANG_META = {
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


def test_sglang_meta_info_at_top_level() -> None:
    obs = Observation()
    capture(chat_body(meta_info=dict(SGLANG_META)), obs)
    assert obs.upstream == {"meta_info": SGLANG_META}
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["method"] == "upstream:sglang"
    assert obs.spec_decoding["num_drafts"] == 10
    assert obs.spec_decoding["num_accepted_tokens"] == 22  # (3.2 - 1) * 10
    assert obs.spec_decoding["mean_acceptance_length"] == pytest.approx(3.2)
    assert obs.spec_decoding["draft_acceptance_rate"] == pytest.approx(0.55)


def test_sglang_meta_info_inside_a_choice_and_without_a_rate() -> None:
    meta = {k: v for k, v in SGLANG_META.items() if k != "spec_accept_rate"}
    body = chat_body()
    body["choices"][0]["meta_info"] = meta
    obs = Observation()
    capture(body, obs)
    assert obs.upstream == {"meta_info": meta}
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["num_accepted_tokens"] == 22
    assert obs.spec_decoding["draft_acceptance_rate"] is None


def test_sglang_without_speculation_gives_no_spec() -> None:
    meta = {k: v for k, v in SGLANG_META.items() if not k.startswith("spec_")}
    obs = Observation()
    capture(chat_body(meta_info=meta), obs)
    assert obs.spec_decoding is None and obs.upstream == {"meta_info": meta}


LLAMA_TIMINGS = {
    "prompt_n": 12,
    "prompt_ms": 30.1,
    "prompt_per_token_ms": 2.508,
    "prompt_per_second": 398.7,
    "predicted_n": 32,
    "predicted_ms": 400.2,
    "predicted_per_token_ms": 12.5,
    "predicted_per_second": 79.96,
    "draft_n": 40,
    "draft_n_accepted": 26,
}


def test_llama_cpp_timings_with_a_draft_model() -> None:
    obs = Observation()
    capture(chat_body(timings=dict(LLAMA_TIMINGS)), obs)
    assert obs.upstream == {"timings": LLAMA_TIMINGS}
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["method"] == "upstream:llama.cpp"
    assert obs.spec_decoding["num_draft_tokens"] == 40
    assert obs.spec_decoding["num_accepted_tokens"] == 26
    assert obs.spec_decoding["draft_acceptance_rate"] == pytest.approx(0.65)
    assert obs.spec_decoding["num_drafts"] is None  # llama.cpp does not count verification steps
    assert obs.spec_decoding["mean_acceptance_length"] is None


def test_llama_cpp_timings_without_drafting() -> None:
    timings = {k: v for k, v in LLAMA_TIMINGS.items() if not k.startswith("draft_")}
    obs = Observation()
    capture({**chat_body(), "timings": timings}, obs)
    assert obs.spec_decoding is None
    assert obs.upstream == {"timings": timings}


def test_plain_openai_body_leaves_no_upstream_stats() -> None:
    obs = Observation()
    capture(chat_body(), obs)
    assert obs.upstream == {} and obs.spec_decoding is None
    assert (obs.prompt_tokens, obs.completion_tokens, obs.finish_reason) == (12, 32, "length")


def test_odd_shapes_are_ignored() -> None:
    obs = Observation()
    capture({"choices": None, "usage": None, "metrics": "n/a", "timings": [1, 2]}, obs)
    capture({"choices": ["not a dict"], "meta_info": None}, obs)
    assert obs.upstream == {} and obs.spec_decoding is None and obs.prompt_tokens is None


def test_another_specgate_upstream_is_read_consistently_with_its_own_counters() -> None:
    """A specgate backend's `metrics` names its counts like vLLM's, so a front gateway must read the
    same numbers the backend reports in its own `spec_decoding`."""
    stats = RequestStats(arrival_time=0.0, num_prompt_tokens=5, num_output_tokens=12)
    stats.spec = SpecStats("ngram")
    for drafted, accepted in [(4, 2), (4, 4), (4, 0)]:
        stats.spec.record(drafted, accepted)
    inner = metrics_from_stats(stats, RouteDecision("m", ["embedded"], None))
    assert inner["spec_decoding"]["num_drafts"] == 3
    assert inner["spec_decoding"]["num_accepted_tokens"] == 6

    obs = Observation()
    capture(chat_body(metrics=inner), obs)
    assert obs.spec_decoding is not None
    assert obs.spec_decoding["num_drafts"] == inner["spec_decoding"]["num_drafts"]
    assert obs.spec_decoding["num_accepted_tokens"] == inner["spec_decoding"]["num_accepted_tokens"]
    assert obs.spec_decoding["mean_acceptance_length"] == pytest.approx(
        inner["spec_decoding"]["mean_acceptance_length"]
    )


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
    obs = Observation()
    capture(chat_body(usage={**USAGE, "prompt_tokens_details": details}), obs)
    assert obs.cached_tokens == expected
    assert obs.prompt_tokens == 12  # the rest of the usage is read either way


def test_a_stream_reports_cached_tokens_in_its_usage_chunk() -> None:
    obs = Observation()
    capture({"choices": [{"index": 0, "delta": {"content": "x"}}]}, obs)
    assert obs.cached_tokens is None
    capture({"choices": [], "usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}}}, obs)
    assert obs.cached_tokens == 4
