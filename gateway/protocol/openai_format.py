"""OpenAI response and chunk bodies, and the `metrics` extension, as small pure functions."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from specgate.engine.outputs import RequestStats, TokenLogprob
from specgate.gateway.protocol.route import RouteDecision

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (prompt tokens served from the prefix cache) goes
    into `prompt_tokens_details` as OpenAI and vLLM report it, and is left out when unknown."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,  # the choice (n > 1)
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,  # the choice (n > 1)
) -> dict[str, Any]:
    choice = completion_choice(index, text, finish_reason, logprobs)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def chat_choice(
    index: int, message: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(
    rid: str,
    created: int,
    model: str,
    message: dict[str, Any],
    finish_reason: str | None,
    use: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = chat_choice(0, message, finish_reason, logprobs)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def completion_response(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    use: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = completion_choice(0, text, finish_reason, logprobs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


# A token a grammar refuses has logprob -inf, which JSON cannot say; vLLM reports this floor instead.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(lps: Sequence[TokenLogprob], text_of: TokenText, top_n: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = text_of(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top[:top_n]]}
            for lp in lps
        ]
    }


def completion_logprobs(
    lps: Sequence[TokenLogprob], text_of: TokenText, top_n: int, offset: int
) -> dict[str, Any]:
    tokens = [text_of(lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(lp.logprob) for lp in lps],
        "top_logprobs": [{text_of(t): _finite(v) for t, v in lp.top[:top_n]} for lp in lps],
        "text_offset": offsets,
    }


def metrics_from_stats(stats: RequestStats, route: RouteDecision | None) -> dict[str, Any]:
    """The per-request `metrics` extension, named like vLLM's RequestMetrics (unix-time stamps)."""
    shift = time.time() - time.monotonic()

    def wall(t: float | None) -> float | None:
        return None if t is None else t + shift

    out: dict[str, Any] = {
        "arrival_time": wall(stats.arrival_ts),
        "first_scheduled_time": wall(stats.scheduled_ts),
        "first_token_time": wall(stats.first_token_ts),
        "last_token_time": wall(stats.last_token_ts),
        "finished_time": wall(stats.finished_ts),
        "time_in_queue": stats.queue_time,
        "ttft": stats.ttft,
        "tpot": stats.tpot,
        "num_steps": stats.num_steps,
        "num_preemptions": stats.num_preemptions,
        "route": route.as_dict() if route is not None else None,
    }
    out["spec_decoding"] = spec_decoding(stats)
    # vLLM's layout: index 0 counts verification steps, index i the drafts accepted at position i.
    spec = stats.spec
    out["spec_token_acceptance_counts"] = (
        [spec.num_drafts, *spec.num_accepted_tokens_per_pos] if spec else None
    )
    return out


def metrics_of_choices(stats: Sequence[RequestStats], route: RouteDecision | None) -> dict[str, Any]:
    """`metrics` of a request with n > 1 choices: its sequences' counters together
    (RequestStats.merged: tokens and speculation counters summed, the earliest first token), `tpot`
    the mean of each choice's own, and `n`."""
    out = metrics_from_stats(RequestStats.merged(stats), route)
    tpots = [t for t in (s.tpot for s in stats) if t is not None]
    out["tpot"] = sum(tpots) / len(tpots) if tpots else None
    out["n"] = len(stats)
    return out


def spec_decoding(stats: RequestStats) -> dict[str, Any]:
    spec = stats.spec
    # Drafted tokens a grammar forced: a constrained request drafts them with or without a method.
    forced = stats.num_forced_draft_tokens
    if spec is None:
        return {"method": None, "num_forced_draft_tokens": forced}
    return {
        "num_forced_draft_tokens": forced,
        "method": spec.method,
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(spec.num_accepted_tokens_per_pos),
        "mean_acceptance_length": spec.mean_acceptance_length,
        "draft_acceptance_rate": spec.draft_acceptance_rate,
        "num_tree_drafts": spec.num_tree_drafts,
        "mean_draft_nodes": spec.mean_draft_nodes,
        "mean_accepted_depth": spec.mean_accepted_depth,
    }
