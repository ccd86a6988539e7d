"""Reading the timing and speculation fields other servers put in their responses.

The shapes read, as each server sends them (in a response body, or in the stream chunk that
carries them; per choice or at the top level):

- vLLM today (`--enable-per-request-metrics`; `PerRequestMetrics` in
  vllm/entrypoints/generate/base/protocol.py): `metrics` with `queue_time_ms`,
  `time_to_first_token_ms` (from scheduling, so the queue is added to it), `generation_time_ms`,
  `mean_itl_ms` and `speculative_decoding` (`num_spec_steps`, `num_draft_tokens`,
  `num_accepted_draft_tokens`, `acceptance_histogram`: [j] steps that accepted exactly j drafts).
  Streamed, on the final usage chunk.
- vLLM before that: `RequestMetrics` times (`arrival_time`, `first_token_time`, `last_token_time`,
  `finished_time`, `time_in_queue`) and `spec_token_acceptance_counts` ([0] verification steps,
  [i] drafts accepted at position i).
- another specgate: its `metrics` (`protocol/openai_format.py` `metrics_from_stats`: the names of
  vLLM's RequestMetrics, `ttft` / `tpot` in seconds, and `spec_decoding` in our own vocabulary); in
  front of an external backend, that backend's raw fields nested under `metrics.upstream`.
- SGLang: `meta_info` (native /generate) with `e2e_latency`, `spec_verify_ct`,
  `spec_accept_length` (completion tokens per verification step), `spec_accept_rate`,
  `spec_num_correct_drafts` / `spec_num_proposed_drafts` / `spec_correct_drafts_histogram` (and
  their older names), `cached_tokens`; with `--enable-metrics` also `request_received_ts`,
  `prefill_finished_ts` (or the scheduler's `prefill_finished_time`), `queue_time` and
  `decode_throughput`. It reports no time to first token of its own: that is the span between
  those two stamps.
- llama.cpp's server: `timings` with `cache_n`, `prompt_ms`, `predicted_n`, `predicted_ms`,
  `predicted_per_token_ms`, and `draft_n` / `draft_n_accepted` when it drafts.

Whatever is found is kept raw in `Observation.upstream`; speculation goes to
`Observation.spec_decoding` in our vocabulary, and the backend's own time to first token, time per
output token and queue time to `backend_ttft` / `backend_tpot` / `queue_time` (seconds).

Every number from an upstream is untrusted: one that is not a number of the right kind, not
finite, negative, or absurd (a count past 2**31 - 1, a duration past a day) is ignored on its own,
and timings of one shape that contradict each other (a first token after the end) are all
dropped. Nothing here raises on any JSON value.
"""

from __future__ import annotations

import math
from typing import Any

from specgate.gateway.backends.base import Observation

_KEYS = ("metrics", "meta_info", "timings")
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 86_400.0  # a duration longer than a day is no request's
MAX_POSITIONS = 64  # draft positions kept (the engine's own limit is far below)
_METHOD_CHARS = 48  # `upstream:` + this fits the 64 characters of the spec_method column

# Counters and averages of specgate's `spec_decoding` that come through from another specgate.
_SPEC_COUNTS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_tree_drafts",
    "num_forced_draft_tokens",
)
_SPEC_MEANS = ("mean_draft_nodes", "mean_accepted_depth")
_SPEC_CORE = (  # the counters every upstream's speculation is given, None where it did not say
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_accepted_tokens_per_pos",
    "mean_acceptance_length",
    "draft_acceptance_rate",
)
_VLLM_TIMES = (
    "time_to_first_token_ms",
    "queue_time_ms",
    "generation_time_ms",
    "mean_itl_ms",
    "time_per_output_token_ms",
    "inter_token_latency_ms",
    "e2e_latency_ms",
)

Timing = tuple[float | None, float | None, float | None]  # ttft, tpot, queue time (seconds)
_NO_TIMING: Timing = (None, None, None)


def capture(body: dict[str, Any], obs: Observation) -> None:
    """Update `obs` from one response body or stream chunk."""
    use = body.get("usage")
    if isinstance(use, dict):
        obs.prompt_tokens = _count(use.get("prompt_tokens"), obs.prompt_tokens)
        obs.completion_tokens = _count(use.get("completion_tokens"), obs.completion_tokens)
        details = use.get("prompt_tokens_details")
        if isinstance(details, dict):  # OpenAI's and vLLM's prefix-cache hits
            obs.cached_tokens = _count(details.get("cached_tokens"), obs.cached_tokens)
    for choice in body.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("finish_reason"), str) and choice["finish_reason"]:
            obs.finish_reason = choice["finish_reason"]
        for key in _KEYS:
            if isinstance(choice.get(key), dict):
                obs.upstream[key] = choice[key]
    for key in _KEYS:
        if isinstance(body.get(key), dict):
            obs.upstream[key] = body[key]
    if obs.upstream:
        # Read again from everything kept so far: a stream's usage (the token counts a time per
        # token needs) may come in a chunk after its metrics.
        _read(obs)


def _read(obs: Observation) -> None:
    raw = obs.upstream
    meta, timings = _obj(raw.get("meta_info")), _obj(raw.get("timings"))
    # Counts the backend gave outside `usage`, only where `usage` said nothing (it wins when it does).
    if obs.prompt_tokens is None:
        obs.prompt_tokens = _count(meta.get("prompt_tokens"))
    if obs.completion_tokens is None:
        obs.completion_tokens = _count(meta.get("completion_tokens"))
    if obs.cached_tokens is None:
        obs.cached_tokens = _first(_count(meta.get("cached_tokens")), _count(timings.get("cache_n")))
    if (
        obs.cached_tokens is not None
        and obs.prompt_tokens is not None
        and obs.cached_tokens > obs.prompt_tokens
    ):
        obs.cached_tokens = None  # more cached than the whole prompt: not a count to believe
    spec = spec_from_upstream(raw)
    if spec is not None:
        obs.spec_decoding = spec
    ttft, tpot, queue = timing_from_upstream(raw, obs.completion_tokens)
    if ttft is not None:
        obs.backend_ttft = ttft
    if tpot is not None:
        obs.backend_tpot = tpot
    if queue is not None:
        obs.queue_time = queue


# ---- speculation ------------------------------------------------------------------------------


def spec_from_upstream(raw: dict[str, Any]) -> dict[str, Any] | None:
    """Speculation counters in our vocabulary from an upstream's raw fields; None if it says none.
    Where one server has sent two shapes, the newer is read."""
    metrics = _obj(raw.get("metrics"))
    for read in (_specgate_spec, _vllm_spec, _vllm_counts_spec):
        spec = read(metrics)
        if spec is not None:
            return spec
    spec = _sglang_spec(_obj(raw.get("meta_info")))
    return spec if spec is not None else _llama_spec(_obj(raw.get("timings")))


def _specgate_spec(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """Another specgate's `spec_decoding`, as it is (only its method marked as an upstream's)."""
    sd = metrics.get("spec_decoding")
    if not isinstance(sd, dict):
        return None
    out: dict[str, Any] = {key: _count(sd.get(key)) for key in _SPEC_COUNTS}
    per_pos = sd.get("num_accepted_tokens_per_pos")
    out["num_accepted_tokens_per_pos"] = (
        _counts(per_pos[:MAX_POSITIONS]) if isinstance(per_pos, list) else None
    )
    length = _number(sd.get("mean_acceptance_length"))
    out["mean_acceptance_length"] = length if length is not None and length >= 1.0 else None
    rate = _number(sd.get("draft_acceptance_rate"))
    out["draft_acceptance_rate"] = rate if rate is not None and rate <= 1.0 else None
    for key in _SPEC_MEANS:
        out[key] = _number(sd.get(key))
    if all(v is None for v in out.values()) or (
        sd.get("method") is None and not out["num_forced_draft_tokens"]
    ):
        return None  # it did not speculate (and no grammar forced drafts either)
    # Its extras only where it sent them: the object comes through as it was, nothing added.
    out = {k: v for k, v in out.items() if k in _SPEC_CORE or v is not None}
    out["method"] = _upstream_method(sd.get("method"))
    _settle(out)
    return out


def _vllm_spec(metrics: dict[str, Any]) -> dict[str, Any] | None:
    sd = metrics.get("speculative_decoding")
    if not isinstance(sd, dict):
        return None
    steps, accepted = _count(sd.get("num_spec_steps")), _count(sd.get("num_accepted_draft_tokens"))
    drafted = _count(sd.get("num_draft_tokens"))
    per_pos, steps, accepted = _from_histogram(sd.get("acceptance_histogram"), steps, accepted)
    if steps is None and drafted is None and accepted is None:
        return None
    return _spec("vllm", steps, drafted, accepted, per_pos)


def _vllm_counts_spec(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's older `spec_token_acceptance_counts`: [0] verification steps, [i] accepted at i."""
    counts = metrics.get("spec_token_acceptance_counts")
    if not isinstance(counts, list) or not 0 < len(counts) <= MAX_POSITIONS + 1:
        return None
    valid = _counts(counts)
    if valid is None or any(c > valid[0] for c in valid[1:]):
        return None  # a position accepted more often than there were steps: not counts at all
    accepted = sum(valid[1:])
    return _spec("vllm", valid[0], None, accepted if accepted <= MAX_COUNT else None, valid[1:])


def _sglang_spec(meta: dict[str, Any]) -> dict[str, Any] | None:
    steps = _count(meta.get("spec_verify_ct"))
    if steps is None:
        return None
    # Newest names first: SGLang renamed these and kept the old ones as aliases for a while.
    accepted = _first(
        _count(meta.get("spec_num_correct_drafts")),
        _count(meta.get("spec_accepted_drafts")),
        _count(meta.get("spec_accept_token_num")),
    )
    drafted = _first(
        _count(meta.get("spec_num_proposed_drafts")),
        _count(meta.get("spec_proposed_drafts")),
        _count(meta.get("spec_draft_token_num")),
    )
    histogram = meta.get("spec_correct_drafts_histogram")
    if histogram is None:
        histogram = meta.get("spec_accept_histogram")
    per_pos, steps, accepted = _from_histogram(histogram, steps, accepted)
    length = _number(meta.get("spec_accept_length"))  # completion tokens per step, its bonus included
    derived = accepted is None and steps is not None
    if derived and steps == 0:
        accepted = 0
    elif derived and length is not None and length >= 1.0:
        estimate = round((length - 1.0) * (steps or 0))
        accepted = estimate if estimate <= MAX_COUNT else None
    out = _spec("sglang", steps, drafted, accepted, per_pos)
    if derived and length is not None and length >= 1.0 and accepted is not None:
        out["mean_acceptance_length"] = length  # the number it sent, not our rounding of it
    rate = _number(meta.get("spec_accept_rate"))
    if out["draft_acceptance_rate"] is None and rate is not None and rate <= 1.0 and steps:
        out["draft_acceptance_rate"] = rate
    return out


def _llama_spec(timings: dict[str, Any]) -> dict[str, Any] | None:
    if "draft_n" not in timings:
        return None
    # llama.cpp counts drafted and accepted tokens, not verification steps.
    return _spec(
        "llama.cpp", None, _count(timings.get("draft_n")), _count(timings.get("draft_n_accepted")), None
    )


def _from_histogram(
    histogram: Any, steps: int | None, accepted: int | None
) -> tuple[list[int] | None, int | None, int | None]:
    """Accepted drafts by position from a histogram of steps by drafts accepted ([j]: steps that
    accepted exactly j): position p was accepted in every step that accepted p or more. Also the
    steps and accepted counts it implies, where those were not given; a histogram that disagrees
    with counts that were given is dropped."""
    if not isinstance(histogram, list) or not 0 < len(histogram) <= MAX_POSITIONS + 1:
        return None, steps, accepted
    valid = _counts(histogram)
    if valid is None:
        return None, steps, accepted
    total, weighted = sum(valid), sum(j * c for j, c in enumerate(valid))
    if total > MAX_COUNT or weighted > MAX_COUNT:
        return None, steps, accepted
    if (steps is not None and steps != total) or (accepted is not None and accepted != weighted):
        return None, steps, accepted
    per_pos = [sum(valid[p:]) for p in range(1, len(valid))]
    return per_pos, total, weighted


def _spec(
    source: str, steps: int | None, drafted: int | None, accepted: int | None, per_pos: list[int] | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "method": f"upstream:{source}",
        "num_drafts": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": None,
        "draft_acceptance_rate": None,
    }
    _settle(out)
    return out


def _settle(out: dict[str, Any]) -> None:
    """Drop what the counts contradict, and fill the averages they imply (vLLM's definitions: a
    step yields its accepted drafts plus one token of the target's own)."""
    steps, drafted, accepted = out["num_drafts"], out["num_draft_tokens"], out["num_accepted_tokens"]
    if drafted is not None and accepted is not None and accepted > drafted:
        out["num_draft_tokens"] = drafted = None  # more accepted than drafted: one of them is wrong
        out["draft_acceptance_rate"] = None
    if out["mean_acceptance_length"] is None and steps and accepted is not None:
        out["mean_acceptance_length"] = (accepted + steps) / steps
    if out["draft_acceptance_rate"] is None and drafted and accepted is not None:
        out["draft_acceptance_rate"] = accepted / drafted


def _upstream_method(method: Any) -> str | None:
    """The inner method, marked as an upstream's (once: a chain of gateways does not stack it)."""
    if method is None:
        return None
    if not (isinstance(method, str) and 0 < len(method) <= _METHOD_CHARS and method.isprintable()):
        return "upstream:specgate"
    return method if method.startswith("upstream:") else f"upstream:{method}"


# ---- timings ----------------------------------------------------------------------------------


def timing_from_upstream(raw: dict[str, Any], completion_tokens: int | None, nested: bool = True) -> Timing:
    """The backend's own time to first token, time per output token and queue time (seconds; None
    where it did not say), field by field from the newest shape that gives it."""
    metrics, meta, timings = (_obj(raw.get(key)) for key in _KEYS)
    found = [
        _vllm_timing(metrics, completion_tokens),
        _request_metrics_timing(metrics, completion_tokens),
        _sglang_timing(meta, completion_tokens),
        _llama_timing(timings),
    ]
    inner = metrics.get("upstream")
    if nested and isinstance(inner, dict):
        # A specgate in front of an external backend: what that backend measured (one level only).
        found.append(timing_from_upstream(inner, completion_tokens, nested=False))
    ttft, tpot, queue = (_first(*(t[i] for t in found)) for i in range(3))
    return ttft, tpot, queue


def _vllm_timing(metrics: dict[str, Any], n: int | None) -> Timing:
    if not any(key in metrics for key in _VLLM_TIMES):
        return _NO_TIMING
    queue = _seconds(metrics.get("queue_time_ms"), 1e-3, zero=True)
    scheduled_to_first = _seconds(metrics.get("time_to_first_token_ms"), 1e-3)
    # vLLM counts its time to first token from scheduling: the request's own adds the queue.
    ttft = None if scheduled_to_first is None else _seconds(scheduled_to_first + (queue or 0.0))
    e2e = _seconds(metrics.get("e2e_latency_ms"), 1e-3)
    tpot = _first(
        _seconds(metrics.get("mean_itl_ms"), 1e-3),
        _seconds(metrics.get("time_per_output_token_ms"), 1e-3),
        _seconds(metrics.get("inter_token_latency_ms"), 1e-3),
        _per_token(_seconds(metrics.get("generation_time_ms"), 1e-3), n),
        _per_token(_span(ttft, e2e), n),
    )
    return _consistent(ttft, tpot, queue, e2e, n)


def _request_metrics_timing(metrics: dict[str, Any], n: int | None) -> Timing:
    """vLLM's older RequestMetrics stamps (unix seconds), which specgate's `metrics` also carries
    beside its own `ttft` / `tpot` (seconds)."""
    arrival, first = _stamp(metrics.get("arrival_time")), _stamp(metrics.get("first_token_time"))
    last, finished = _stamp(metrics.get("last_token_time")), _stamp(metrics.get("finished_time"))
    ttft = _first(_seconds(metrics.get("ttft")), _span(arrival, first))
    tpot = _first(_seconds(metrics.get("tpot")), _per_token(_span(first, _first(last, finished)), n))
    queue = _seconds(metrics.get("time_in_queue"), zero=True)
    return _consistent(ttft, tpot, queue, _span(arrival, finished), n)


def _sglang_timing(meta: dict[str, Any], n: int | None) -> Timing:
    e2e = _seconds(meta.get("e2e_latency"))
    received = _stamp(meta.get("request_received_ts"))
    first = _first(_stamp(meta.get("prefill_finished_ts")), _stamp(meta.get("prefill_finished_time")))
    ttft = _span(received, first)
    throughput = _number(meta.get("decode_throughput"))  # output tokens per second of decoding
    tpot = _first(
        _seconds(1.0 / throughput) if throughput else None,
        _per_token(_span(ttft, e2e), n),
    )
    return _consistent(ttft, tpot, _seconds(meta.get("queue_time"), zero=True), e2e, n)


def _llama_timing(timings: dict[str, Any]) -> Timing:
    # Its prefill time is the closest it comes to a time to first token (a slot's wait excluded);
    # 0 is its "not measured yet", never a measurement.
    ttft = _seconds(timings.get("prompt_ms"), 1e-3)
    predicted = _count(timings.get("predicted_n"))
    tpot = _first(
        _seconds(timings.get("predicted_per_token_ms"), 1e-3),
        _per_token(_seconds(timings.get("predicted_ms"), 1e-3), predicted),
    )
    return ttft, tpot, None


def _consistent(
    ttft: float | None, tpot: float | None, queue: float | None, e2e: float | None, n: int | None
) -> Timing:
    """One shape's timings, or none of them where they contradict its own end-to-end time."""
    if e2e is not None:
        decode = tpot * (n - 1) if tpot is not None and n is not None and n > 1 else 0.0
        if not (_within(ttft, e2e) and _within(queue, e2e) and _within((ttft or 0.0) + decode, e2e)):
            return _NO_TIMING
    return ttft, tpot, queue


def _within(part: float | None, whole: float) -> bool:
    return part is None or part <= whole * (1 + 1e-6) + 1e-6  # its own rounding is no contradiction


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else _seconds(end - start)


def _per_token(total: float | None, n: int | None) -> float | None:
    """Time per output token after the first (the first comes with the prefill)."""
    return None if total is None or n is None or n < 2 else _seconds(total / (n - 1))


# ---- untrusted values -------------------------------------------------------------------------


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _count(value: Any, default: int | None = None) -> int | None:
    """A count from an upstream: a non-negative int in range, else `default` (the count we had)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return default


def _counts(values: list[Any]) -> list[int] | None:
    """A list of counts, or None if any of them is not one (a list with holes says nothing)."""
    out = [_count(v) for v in values]
    return None if any(c is None for c in out) else [c for c in out if c is not None]


def _number(value: Any) -> float | None:
    """A finite non-negative number no larger than the largest count, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        return None
    return number if math.isfinite(number) and 0.0 <= number <= MAX_COUNT else None


def _seconds(value: Any, scale: float = 1.0, zero: bool = False) -> float | None:
    """A duration in seconds (`value` times `scale`): positive (or zero, where a wait may be none)
    and at most a day."""
    number = _number(value)
    if number is None:
        return None
    seconds = number * scale
    return seconds if (seconds > 0.0 or (zero and seconds == 0.0)) and seconds <= MAX_SECONDS else None


def _stamp(value: Any) -> float | None:
    """A unix (or monotonic) time in seconds: only a positive finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and number > 0.0 else None
