"""A pass-through request's life: the external backends that serve its model, failover, the answer.

Shared by /v1/embeddings, /v1/rerank and (for an external model) /tokenize and /detokenize. The
backend's JSON answer goes back as it came (its `model` renamed to the public name); its errors
are OpenAI-shaped like any other. A tracked request (embeddings, rerank: the middleware made a
tracker for them) leaves its row as an inference request does: the caller, the backend that
served, the prompt tokens its `usage` reports, and how it ended.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.responses import Response

from specgate.gateway.backends.relay import RelayCall, Relayed
from specgate.gateway.backends.upstream.answers import MAX_USAGE
from specgate.gateway.http.deps import ServicesDep, api_key
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.http.sse import ClientDisconnected, until_disconnect
from specgate.gateway.limits.limiters import release
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.request.context import Caller
from specgate.gateway.request.tracker import RequestTracker
from specgate.gateway.routing import dispatch
from specgate.gateway.routing.relay import relay_backends
from specgate.gateway.services import Services

# What each endpoint is called in a refusal ("does not serve embeddings").
WHAT: dict[Relayed, str] = {
    "embeddings": "embeddings",
    "rerank": "reranking",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


def tracker_of(request: Request) -> RequestTracker | None:
    """The request's tracker (the middleware makes one for the tracked pass-through paths)."""
    tracker: RequestTracker | None = getattr(request.state, "tracker", None)
    return tracker


async def tracked_caller(request: Request, svc: ServicesDep) -> Caller:
    """`deps.api_key` (key, rate limit, in-flight cap), told the request's tracker, so that a
    request refused here still leaves its row with its key and the reason."""
    tracker = tracker_of(request)
    try:
        return await api_key(request, svc, tracker)
    except GatewayError as err:
        if tracker is not None:
            tracker.refused(err.code)
        raise


TrackedCallerDep = Annotated[Caller, Depends(tracked_caller)]


def noted(tracker: RequestTracker | None, err: GatewayError) -> GatewayError:
    """The error, its code noted for the row: FastAPI renders it before the middleware would."""
    if tracker is not None:
        tracker.refused(err.code)
    return err


async def relay(
    svc: Services,
    request: Request,
    body: dict[str, Any],
    model: str,
    endpoint: Relayed,
    path: str,
    root: bool = False,
) -> Response:
    """Relay `body` (as validated, unknown fields kept) to the first backend of `model` that answers;
    `path` below its base URL (or, with `root`, below the server's root)."""
    tracker = tracker_of(request)
    ctx = tracker.context if tracker is not None else None
    request_id = ctx.request_id if ctx is not None else f"relay-{time.time_ns()}"
    try:
        candidates = relay_backends(svc.settings, svc.registry, model, WHAT[endpoint])
        if "cache_salt" in body:
            body = _salted(svc, tracker, body)
        call = RelayCall(request_id, endpoint, model, body, path, root)
        if tracker is not None:
            tracker.call = call
            tracker.overhead_ms = (time.perf_counter() - tracker.context.arrival_perf) * 1e3
        answer, backend = await until_disconnect(request, dispatch.relay(call, candidates))
    except ClientDisconnected:
        if tracker is not None:
            tracker.cancelled()
        return Response(status_code=499)
    except GatewayError as err:
        raise noted(tracker, err.for_client(svc.settings.retry_after_seconds)) from None
    finally:
        if tracker is not None:
            tracker.ended()
    if backend is not candidates[0]:
        svc.metrics.failovers.labels(svc.metrics.model_label(model)).inc()
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(prompt, int) and not isinstance(prompt, bool) and 0 <= prompt <= MAX_USAGE:
        call.observed.prompt_tokens = prompt
    release(getattr(request.state, "held", None))  # the answer is made: its slot goes back now
    return SafeJSONResponse(answer)


def _salted(svc: Services, tracker: RequestTracker | None, body: dict[str, Any]) -> dict[str, Any]:
    """As for chat (`OpenAIBackend._payload`): a client's own `cache_salt` would partition the
    backend's cache across all our tenants, so it gets the tenant's salt instead (combined with the
    client's), or where the gateway shares cached prompts with nobody, one of its own."""
    salt = body["cache_salt"]
    caller = tracker.caller if tracker is not None else None
    ours = None
    if caller is not None and tracker is not None:
        ours = svc.prefix_salt(
            caller.key_id, tracker.context.client_addr, salt if isinstance(salt, str) else None
        )
    return {**body, "cache_salt": ours or f"once:{secrets.token_hex(16)}"}
