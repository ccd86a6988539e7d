"""POST /v1/embeddings, and POST /v1/rerank (/rerank): relayed to the model's external backends.

The embedded engine generates text only, so these go to the external backends that serve the
model (with failover), under the checks of an inference request: the body size limit (the
middleware), then the key, rate limit and in-flight cap, then one bounded parse and validation.
The middleware tracks them, so each leaves exactly one telemetry row (endpoint `embeddings` or
`rerank`), refused or not.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.gateway.backends.relay import Relayed
from specgate.gateway.http import body
from specgate.gateway.http.deps import ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.relaying import TrackedCallerDep, noted, relay, tracker_of
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.passthrough_schemas import EmbeddingRequest, RerankRequest

router = APIRouter()


async def _relayed(
    request: Request,
    svc: ServicesDep,
    model: type[EmbeddingRequest] | type[RerankRequest],
    endpoint: Relayed,
    path: str,
) -> Response:
    tracker = tracker_of(request)
    try:
        parsed = await body.parse(request, model, tracker)
    except GatewayError as err:
        raise noted(tracker, err) from None
    # exclude_unset: the backend gets what the client sent (vendor fields included), no defaults.
    return await relay(svc, request, parsed.model_dump(exclude_unset=True), parsed.model, endpoint, path)


@router.post("/v1/embeddings", summary="Embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(request: Request, svc: ServicesDep, _: TrackedCallerDep) -> Response:
    return await _relayed(request, svc, EmbeddingRequest, "embeddings", "/embeddings")


@router.post("/v1/rerank", summary="Rerank", openapi_extra=json_body(RerankRequest))
async def rerank(request: Request, svc: ServicesDep, _: TrackedCallerDep) -> Response:
    return await _relayed(request, svc, RerankRequest, "rerank", "/rerank")


# vLLM, Jina and llama.cpp also serve it without the version prefix.
@router.post("/rerank", summary="Rerank (unversioned)", openapi_extra=json_body(RerankRequest))
async def rerank_unversioned(request: Request, svc: ServicesDep, _: TrackedCallerDep) -> Response:
    return await _relayed(request, svc, RerankRequest, "rerank", "/rerank")
