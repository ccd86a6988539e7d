"""Reading the timing and speculation fields other servers put in their responses.

vLLM: a per-request `metrics` object (RequestMetrics names, `spec_token_acceptance_counts`).
SGLang: `meta_info` with `spec_accept_rate`, `spec_accept_length`, `spec_verify_ct`.
llama.cpp's server: `timings` with `draft_n` / `draft_n_accepted` when it drafts.
Whatever is found is kept raw in `Observation.upstream` and, where it speaks of speculation,
also in our vocabulary in `Observation.spec`.
"""

from __future__ import annotations

from typing import Any

from specgate.gateway.backends.base import Observation

_KEYS = ("metrics", "meta_info", "timings")
MAX_COUNT = 2**31 - 1


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
        if isinstance(choice, dict) and choice.get("finish_reason"):
            obs.finish_reason = choice["finish_reason"]
        for key in _KEYS:
            if isinstance(choice, dict) and isinstance(choice.get(key), dict):
                obs.upstream[key] = choice[key]
    for key in _KEYS:
        if isinstance(body.get(key), dict):
            obs.upstream[key] = body[key]
    try:
        spec = spec_from_upstream(obs.upstream)
    except (TypeError, ValueError, OverflowError, AttributeError):  # fields of the wrong type: ignored
        spec = None
    if spec is not None:
        obs.spec_decoding = spec


def _count(value: Any, default: int | None) -> int | None:
    """A token count from an upstream: a non-negative int in range, else the count we had."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT:
        return value
    return default


def spec_from_upstream(raw: dict[str, Any]) -> dict[str, Any] | None:
    vllm = raw.get("metrics") or {}
    counts = vllm.get("spec_token_acceptance_counts")
    if isinstance(counts, list) and counts:
        # vLLM counts per position, position 0 being the number of verification steps.
        steps = int(counts[0]) or 0
        accepted = sum(int(c) for c in counts[1:])
        return _spec("vllm", steps, None, accepted, [int(c) for c in counts[1:]])
    sg = raw.get("meta_info") or {}
    if "spec_verify_ct" in sg:
        steps = int(sg.get("spec_verify_ct") or 0)
        length = float(sg.get("spec_accept_length") or 0.0)
        accepted = round(max(0.0, length - 1.0) * steps)
        out = _spec("sglang", steps, None, accepted, None)
        out["mean_acceptance_length"] = length
        if sg.get("spec_accept_rate") is not None:
            out["draft_acceptance_rate"] = float(sg["spec_accept_rate"])
        return out
    timings = raw.get("timings") or {}
    if "draft_n" in timings:
        drafted = int(timings.get("draft_n") or 0)
        accepted = int(timings.get("draft_n_accepted") or 0)
        return _spec("llama.cpp", None, drafted, accepted, None)
    return None


def _spec(
    source: str, steps: int | None, drafted: int | None, accepted: int, counts: list[int] | None
) -> dict[str, Any]:
    steps = None if steps is None else min(MAX_COUNT, max(0, steps))
    drafted = None if drafted is None else min(MAX_COUNT, max(0, drafted))
    accepted = min(MAX_COUNT, max(0, accepted))
    if counts is not None:
        counts = [min(MAX_COUNT, max(0, c)) for c in counts[:64]]
    out: dict[str, Any] = {
        "method": f"upstream:{source}",
        "num_drafts": steps,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": counts,
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
    }
    return out
