"""Failover across a route's candidate backends, up to the moment the first byte reaches the client.

A retryable failure (connection refused, 429, 5xx, open breaker) moves on to the next candidate;
any other failure is the client's answer. For a stream, "started" means the first chunk was
produced: until then a failure is still invisible to the client and may fail over.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from specgate.gateway.backends.base import Backend, BackendCall
from specgate.gateway.backends.relay import RelayCall
from specgate.gateway.backends.upstream.backend import OpenAIBackend
from specgate.gateway.protocol.errors import GatewayError

logger = logging.getLogger("specgate.gateway")
B = TypeVar("B", bound=Backend)


def _ordered(candidates: list[B]) -> list[B]:
    # Healthy backends first, in route order; unhealthy ones stay as a last resort.
    return [b for b in candidates if b.healthy] + [b for b in candidates if not b.healthy]


def _passed_over(backend: Backend, request_id: str, err: GatewayError, errors: list[GatewayError]) -> None:
    """A candidate failed before anything reached the client: the error is the client's answer
    unless it is retryable, when it is kept for the final one and the next candidate is tried."""
    if not err.retryable:
        raise err
    logger.info("backend %s failed for %s: %s; trying the next", backend.name, request_id, err.message)
    errors.append(err)


def _exhausted(errors: list[GatewayError]) -> GatewayError:
    if errors and all(e.status == 429 for e in errors):
        waits = [e.retry_after for e in errors if e.retry_after is not None]
        return GatewayError(
            429, errors[-1].message, code="rate_limit_exceeded", retry_after=min(waits) if waits else None
        )
    if len(errors) == 1:
        return errors[0]
    detail = "; ".join(e.message for e in errors)
    waits = [e.retry_after for e in errors if e.retry_after is not None]
    return GatewayError(
        503,
        f"no backend could serve the request: {detail}",
        code="backends_unavailable",
        retry_after=min(waits) if waits else None,
    )


async def complete(call: BackendCall, candidates: list[Backend]) -> tuple[dict[str, Any], Backend]:
    errors: list[GatewayError] = []
    for backend in _ordered(candidates):
        _serving(call, backend)
        try:
            return await backend.complete(call), backend
        except GatewayError as err:
            _passed_over(backend, call.request_id, err, errors)
    raise _exhausted(errors)


async def open_stream(
    call: BackendCall, candidates: list[Backend]
) -> tuple[dict[str, Any], AsyncIterator[dict[str, Any]], Backend]:
    """The first chunk, the rest of the stream, and the backend that produced them."""
    errors: list[GatewayError] = []
    for backend in _ordered(candidates):
        _serving(call, backend)
        stream = aiter(backend.stream(call))
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            errors.append(GatewayError(502, f"backend {backend.name} sent an empty stream", retryable=True))
            continue
        except GatewayError as err:
            await _close(stream)
            _passed_over(backend, call.request_id, err, errors)
            continue
        except BaseException:
            await _close(stream)
            raise
        return first, stream, backend
    raise _exhausted(errors)


async def relay(call: RelayCall, candidates: list[OpenAIBackend]) -> tuple[dict[str, Any], OpenAIBackend]:
    """A pass-through call (embeddings, tokenize, ...): the first answer, failing over as `complete`
    does; the call's observation names the backend that served it."""
    errors: list[GatewayError] = []
    for backend in _ordered(candidates):
        call.observed.backend = backend.name
        try:
            return await backend.relay(call), backend
        except GatewayError as err:
            _passed_over(backend, call.request_id, err, errors)
    raise _exhausted(errors)


def _serving(call: BackendCall, backend: Backend) -> None:
    """This backend takes the call now: what the response's `metrics.route` and the row will name."""
    call.observed.backend = backend.name
    if call.route is not None:
        call.route = call.route.served_by(backend.name, backend.external)


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
