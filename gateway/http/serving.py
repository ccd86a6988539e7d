"""One request's life in the gateway: route, call a backend (with failover), answer.

Shared by the chat and completions endpoints. What it learns goes into the request's tracker (the
load, the route decision, the backend call whose observation the backend fills, how it ended);
the middleware builds the one record from it. Whatever happens (bad input, backend failure, client
disconnect) the client gets an OpenAI-shaped answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from specgate.gateway.backends.base import Backend, BackendCall, Kind, RelayedChunk
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.http.sse import DONE, ClientDisconnected, EventStreamResponse, sse, until_disconnect
from specgate.gateway.limits.limiters import Held, release
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.request.tracker import RequestTracker
from specgate.gateway.routing import dispatch
from specgate.gateway.services import Services

logger = logging.getLogger("specgate.gateway")


class Shape(Protocol):
    """How an answer leaves the gateway in another API's shape (the Responses API: a chat answer
    made a `response`, stored before the client has it). The pipeline is chat's, to the byte."""

    def prepare(self, call: BackendCall) -> None:
        """The call is made, before any backend sees it."""

    async def body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The whole answer (its `metrics` final), as the client gets it."""

    def events(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chunk (the final one with its `metrics`) as the client's events."""

    async def end(self, metrics: dict[str, Any] | None) -> list[bytes]:
        """The stream's last events; `metrics`: the route's, for an answer that had none."""

    def failed(self, error: GatewayError) -> bytes:
        """The event that ends a stream failing after it started."""


async def handle(
    svc: Services,
    request: Request,
    tracker: RequestTracker,
    parsed: ChatCompletionRequest | CompletionRequest,
    kind: Kind,
    shape: Shape | None = None,
) -> Response:
    ctx, caller = tracker.context, tracker.caller
    assert caller is not None  # the route checks the key before the body
    load = svc.load_signals()  # one snapshot: what the record keeps is what the policy saw
    tracker.stream, tracker.load = bool(parsed.stream), load
    streaming = False
    try:
        slo = svc.slo(caller.key_id, request.headers)
        prefix_salt = svc.prefix_salt(caller.key_id, ctx.client_addr, parsed.cache_salt)
        plan = svc.router.plan(parsed, load, slo=slo, scope=prefix_salt)
        decision = tracker.decision = plan.route
        tracker.prefix_blocks = plan.prefix_blocks
        svc.router.admit(plan)
        call = tracker.call = BackendCall(
            request_id=ctx.request_id,
            kind=kind,
            model=parsed.model,
            # by_alias: structured_outputs.json is `json_` in Python, `json` on the wire, as sent.
            body=parsed.model_dump(exclude_unset=True, by_alias=True),
            request=parsed,
            created=int(time.time()),
            spec=decision.spec,
            route=decision,
            cache_scope=svc.cache_scope(caller.key_id, ctx.client_addr),
            prefix_salt=prefix_salt,
            tenant=caller.tenant,
            body_bytes=tracker.body_bytes,
        )
        if shape is not None:
            shape.prepare(call)
        candidates = [b for b in (svc.registry.get(n) for n in decision.backends) if b is not None]
        tracker.overhead_ms = (time.perf_counter() - ctx.arrival_perf) * 1e3
        held = getattr(request.state, "held", None)
        if parsed.stream:
            first, rest, backend = await until_disconnect(request, dispatch.open_stream(call, candidates))
            external = _note_failover(svc, call, backend, decision.backends)
            streaming = True
            done = _Closer(tracker, rest, held)
            return EventStreamResponse(
                _events(svc, tracker, call, first, rest, external, done, shape), on_close=done
            )
        body, backend = await until_disconnect(request, dispatch.complete(call, candidates))
        if _note_failover(svc, call, backend, decision.backends):
            # The embedded engine writes its own metrics; anything else gets ours (theirs nested).
            body["metrics"] = _external_metrics(call, body.get("metrics"))
        if shape is not None:
            body = await shape.body(body)
        release(held)  # the answer is made: the client may send its next request as it reads it
        return SafeJSONResponse(body)
    except ClientDisconnected:
        tracker.cancelled()
        return Response(status_code=499)
    except GatewayError as err:
        raise err.for_client(svc.settings.retry_after_seconds) from None
    finally:
        if not streaming:
            tracker.ended()


async def _events(
    svc: Services,
    tracker: RequestTracker,
    call: BackendCall,
    first: dict[str, Any],
    rest: AsyncIterator[dict[str, Any]],
    external: bool,
    done: _Closer,
    shape: Shape | None = None,
) -> AsyncIterator[bytes]:
    try:
        chunk: dict[str, Any] | None = first
        while chunk is not None:
            choices = chunk.get("choices")
            final = (choices and choices[0].get("finish_reason")) or (not choices and chunk.get("usage"))
            if final and ("metrics" not in chunk or external):
                chunk["metrics"] = _external_metrics(call, chunk.get("metrics"))
                if shape is None:
                    yield sse(chunk)
            elif shape is None:  # an upstream's event goes on as the bytes it came as, if it has them
                yield chunk.event if isinstance(chunk, RelayedChunk) else sse(chunk)
            if shape is not None:
                for event in shape.events(chunk):
                    yield event
            chunk = await anext(rest, None)
        if shape is None:
            tail = [DONE]
        else:  # a proxied Responses stream has no final chunk: the route's metrics go on its end
            tail = await shape.end(_external_metrics(call, None) if external else None)
        done.completed = True  # everything is out but the end marker
        release(done.held)  # before the client reads the end and sends its next request
        for event in tail:
            yield event
    except GatewayError as err:
        error = err.for_client(svc.settings.retry_after_seconds)
        tracker.failed(error.code or "backend_error")
        logger.warning("stream %s failed after it started: %s", call.request_id, err.message)
        done.completed = True
        release(done.held)
        yield error.sse_event() if shape is None else shape.failed(error)
    except (asyncio.CancelledError, GeneratorExit):
        tracker.cancelled()
        raise
    except Exception:
        logger.exception("stream %s failed after it started", call.request_id)
        tracker.failed("internal_error")
        done.completed = True
        release(done.held)
        internal = GatewayError(500, "internal server error", code="internal_error")
        yield internal.sse_event() if shape is None else shape.failed(internal)
    finally:
        await done()


def _note_failover(svc: Services, call: BackendCall, backend: Backend, order: Sequence[str]) -> bool:
    """Count a failover (dispatch named the serving backend on the call); whether it is external."""
    if order and backend.name != order[0]:
        svc.metrics.failovers.labels(svc.metrics.model_label(call.model)).inc()
    return backend.external


def _external_metrics(call: BackendCall, upstream_metrics: Any) -> dict[str, Any]:
    obs = call.observed
    route = call.route.as_dict() if call.route is not None else None
    out: dict[str, Any] = {"route": route, "spec_decoding": obs.spec_decoding or {"method": None}}
    if obs.upstream:
        out["upstream"] = obs.upstream
    elif upstream_metrics is not None:
        out["upstream"] = {"metrics": upstream_metrics}
    return out


class _Closer:
    """Ends a stream's backend side once, whichever runs first: the event generator's `finally`, or
    the response's `on_close` when the generator never started."""

    def __init__(self, tracker: RequestTracker, rest: AsyncIterator[Any], held: Held | None) -> None:
        self.tracker, self.rest, self.done = tracker, rest, False
        self.held = held  # the request's in-flight slots, given back when the stream ends
        self.completed = False  # the stream reached its end ([DONE] or an error event)

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        if not self.completed:
            self.tracker.cancelled()  # it ended before its end: the client left
        try:
            aclose = getattr(self.rest, "aclose", None)
            if aclose is not None:
                await aclose()  # the engine aborts the request, an upstream response is closed
        finally:
            self.tracker.ended()
