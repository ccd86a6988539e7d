"""One request's life in the gateway: route, call a backend (with failover), answer, record.

Shared by the chat and completions endpoints. Whatever happens (bad input, backend failure,
client disconnect) the request leaves exactly one record, and the client an OpenAI-shaped answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from specgate.gateway.backends.base import Backend, BackendCall, Kind, Observation, RelayedChunk
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.http.sse import DONE, ClientDisconnected, EventStreamResponse, sse, until_disconnect
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.routing import dispatch
from specgate.gateway.services import Services
from specgate.gateway.telemetry.records import RequestRecord

logger = logging.getLogger("specgate.gateway")


async def handle(
    svc: Services,
    request: Request,
    parsed: ChatCompletionRequest | CompletionRequest,
    kind: Kind,
    key_id: str | None,
) -> Response:
    state = request.state
    rec: RequestRecord = state.record  # created by the middleware, which also submits it
    load = svc.load_signals()  # one snapshot: what the record keeps is what the policy saw
    rec.model, rec.stream, rec.load = parsed.model, bool(parsed.stream), svc.load_snapshot(load)
    streaming = False
    call: BackendCall | None = None
    try:
        decision = svc.router.route(parsed, load)
        rec.route = decision
        rec.features = decision.features
        rec.workload_class = decision.workload_class
        rec.class_confidence = decision.class_confidence
        call = BackendCall(
            request_id=state.request_id,
            kind=kind,
            model=parsed.model,
            body=parsed.model_dump(exclude_unset=True),
            request=parsed,
            created=int(time.time()),
            spec=decision.spec,
            route=decision,
            cache_scope=svc.cache_scope(key_id, state.client_addr),
            prefix_salt=svc.prefix_salt(key_id, state.client_addr, parsed.cache_salt),
            tenant=getattr(state, "tenant", ""),
            body_bytes=getattr(state, "body_bytes", 0),
        )
        candidates = [b for b in (svc.registry.get(n) for n in decision.backends) if b is not None]
        rec.overhead_ms = (time.perf_counter() - state.received_perf) * 1e3
        if parsed.stream:
            first, rest, backend = await until_disconnect(request, dispatch.open_stream(call, candidates))
            external = _note_backend(svc, rec, call, backend, decision.backends)
            streaming = True
            done = _Closer(rec, call, rest)
            return EventStreamResponse(_events(svc, rec, call, first, rest, external, done), on_close=done)
        body, backend = await until_disconnect(request, dispatch.complete(call, candidates))
        if _note_backend(svc, rec, call, backend, decision.backends):
            # The embedded engine writes its own metrics; anything else gets ours (theirs nested).
            body["metrics"] = _external_metrics(call, body.get("metrics"))
        return SafeJSONResponse(body)
    except ClientDisconnected:
        rec.outcome = "cancelled"
        return Response(status_code=499)
    except GatewayError as err:
        raise err.for_client(svc.settings.retry_after_seconds) from None
    finally:
        if not streaming:
            _close(rec, call)


async def _events(
    svc: Services,
    rec: RequestRecord,
    call: BackendCall,
    first: dict[str, Any],
    rest: AsyncIterator[dict[str, Any]],
    external: bool,
    done: _Closer,
) -> AsyncIterator[bytes]:
    try:
        chunk: dict[str, Any] | None = first
        while chunk is not None:
            choices = chunk.get("choices")
            final = (choices and choices[0].get("finish_reason")) or (not choices and chunk.get("usage"))
            if final and ("metrics" not in chunk or external):
                chunk["metrics"] = _external_metrics(call, chunk.get("metrics"))
                yield sse(chunk)
            else:  # an upstream's event goes on as the bytes it came as, if it has them
                yield chunk.event if isinstance(chunk, RelayedChunk) else sse(chunk)
            chunk = await anext(rest, None)
        done.completed = True  # everything is out but the end marker
        yield DONE
    except GatewayError as err:
        error = err.for_client(svc.settings.retry_after_seconds)
        rec.outcome, rec.error_code = "error", error.code or "backend_error"
        logger.warning("stream %s failed after it started: %s", rec.request_id, err.message)
        done.completed = True
        yield error.sse_event()
    except (asyncio.CancelledError, GeneratorExit):
        rec.outcome = "cancelled"
        raise
    except Exception:
        logger.exception("stream %s failed after it started", rec.request_id)
        rec.outcome, rec.error_code = "error", "internal_error"
        done.completed = True
        yield GatewayError(500, "internal server error", code="internal_error").sse_event()
    finally:
        await done()


def _note_backend(
    svc: Services, rec: RequestRecord, call: BackendCall, backend: Backend, order: list[str]
) -> bool:
    """Record which backend took the call (dispatch named it on the route); whether it is external."""
    rec.backend = backend.name
    if order and backend.name != order[0]:
        svc.metrics.failovers.labels(svc.metrics.model_label(call.model)).inc()
    return backend.external


def _external_metrics(call: BackendCall, upstream_metrics: Any) -> dict[str, Any]:
    obs = call.observed
    route = call.route.as_dict() if call.route is not None else None
    out: dict[str, Any] = {"route": route, "spec_decoding": obs.spec or {"method": None}}
    if obs.upstream:
        out["upstream"] = obs.upstream
    elif upstream_metrics is not None:
        out["upstream"] = {"metrics": upstream_metrics}
    return out


def _observe(rec: RequestRecord, obs: Observation) -> None:
    rec.first_token_at = obs.first_token_time
    rec.finish_reason = obs.finish_reason
    rec.prompt_tokens = obs.prompt_tokens
    rec.completion_tokens = obs.completion_tokens
    rec.cached_tokens = obs.cached_tokens
    rec.queue_ms = None if obs.queue_time is None else obs.queue_time * 1e3
    rec.spec = obs.spec
    rec.upstream = obs.upstream
    rec.attempts = obs.attempts
    rec.spec_steps = obs.spec_steps


class _Closer:
    """Ends a stream's backend side once, whichever runs first: the event generator's `finally`, or
    the response's `on_close` when the generator never started."""

    def __init__(self, rec: RequestRecord, call: BackendCall, rest: AsyncIterator[Any]) -> None:
        self.rec, self.call, self.rest, self.done = rec, call, rest, False
        self.completed = False  # the stream reached its end ([DONE] or an error event)

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if not self.completed and self.rec.outcome == "ok":
            self.rec.outcome = "cancelled"  # it ended before its end: the client left
        try:
            aclose = getattr(self.rest, "aclose", None)
            if aclose is not None:
                await aclose()  # the engine aborts the request, an upstream response is closed
        finally:
            _close(self.rec, self.call)


def _close(rec: RequestRecord, call: BackendCall | None) -> None:
    """What the backend observed goes into the record; the middleware settles and submits it."""
    if call is not None:
        _observe(rec, call.observed)
        if call.observed.backend and rec.backend is None:
            rec.backend = call.observed.backend
    rec.finish()
