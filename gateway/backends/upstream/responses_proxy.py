"""A Responses API request sent to an upstream that serves that API itself (`responses_api`).

The upstream gets the request as the client sent it, with two changes: the conversation a
`previous_response_id` named is already in `input` (the gateway stores conversations, so the
upstream is asked to store nothing), and a `cache_salt` is replaced by the call's own, as on chat.
Its events are relayed as the bytes they came as; what the gateway counts (first output, usage,
how it ended) is read from them here. An `error` event or a failed response ends the stream as an
upstream failure does on chat.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from specgate.gateway.backends.base import BackendCall
from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.responses_format import TERMINAL_EVENTS, finish_of, upstream_usage
from specgate.gateway.settings import BackendSettings

_OUTPUT_DELTAS = frozenset({"response.output_text.delta", "response.function_call_arguments.delta"})


def proxies(settings: BackendSettings, call: BackendCall) -> bool:
    return call.responses_body is not None and settings.responses_api


def target(settings: BackendSettings, call: BackendCall) -> tuple[str | None, bytes | None]:
    """Where and what to send: the upstream's /responses and the Responses body for a call it
    proxies, (None, None) (the chat path and body) for any other."""
    if call.responses_body is None or not settings.responses_api:
        return None, None
    body = {**call.responses_body, "model": settings.models.get(call.model, call.model)}
    if body.get("cache_salt") is not None:
        body["cache_salt"] = call.prefix_salt or f"once:{secrets.token_hex(16)}"
    return f"{settings.base_url}/responses", json_codec.encode(body)


def observe(body: dict[str, Any], call: BackendCall) -> None:
    """A whole Responses object: its counts and outcome on the call's observation."""
    obs = call.observed
    prompt, completion, cached = upstream_usage(body)
    obs.prompt_tokens = prompt if prompt is not None else obs.prompt_tokens
    obs.completion_tokens = completion if completion is not None else obs.completion_tokens
    obs.cached_tokens = cached if cached is not None else obs.cached_tokens
    obs.finish_reason = finish_of(body) or obs.finish_reason
    call.responses_proxied = True


def observe_event(event: dict[str, Any], call: BackendCall, backend: str) -> None:
    """One streamed event; an `error` event or a failed response raises (a 502, as a chat
    stream's error event does)."""
    kind = event.get("type")
    call.responses_proxied = True
    if kind in _OUTPUT_DELTAS and call.observed.first_token_time is None:
        call.observed.first_token_time = time.time()
    elif kind == "error" or kind == "response.failed":
        error = event if kind == "error" else (event.get("response") or {}).get("error")
        detail = error if isinstance(error, dict) else {}
        said = detail.get("message")
        message = said if isinstance(said, str) else "error"
        code = detail.get("code")
        raise GatewayError(
            502, f"backend {backend}: {message[:200]}", code=code if isinstance(code, str) else None
        )
    elif kind in TERMINAL_EVENTS and isinstance(event.get("response"), dict):
        observe(event["response"], call)
