"""POST /tokenize and POST /detokenize, in vLLM's and llama.cpp's shapes.

The embedded model's are answered here with its own tokenizer and chat template
(`backends/embedded/tokenize.py`), as vLLM answers them; an external model's are relayed to its
backend's own `/tokenize` / `/detokenize` (below the server's root, where vLLM and llama.cpp serve
them) and answered as it answers. Cheap and generating nothing, they are treated like /v1/models:
the key, rate limit and in-flight cap apply, and they leave no telemetry row.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.responses import Response

from specgate.gateway.backends.embedded import tokenize as embedded
from specgate.gateway.backends.relay import Relayed
from specgate.gateway.engine_core.model_info import ModelInfo
from specgate.gateway.http import body
from specgate.gateway.http.deps import ApiKeyDep, ServicesDep
from specgate.gateway.http.openapi import json_body
from specgate.gateway.http.relaying import relay
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.passthrough_schemas import DetokenizeRequest, TokenizeRequest
from specgate.gateway.routing.router import candidate_backends
from specgate.gateway.services import Services

router = APIRouter()
OFF_LOOP_BYTES = 8192  # bodies above this are tokenized in a worker thread (as the engine's prompts are)

R = TypeVar("R", TokenizeRequest, DetokenizeRequest)


def _target(svc: Services, model: str | None) -> tuple[str, ModelInfo | None]:
    """The public model the request is for, and the embedded model's info if the embedded engine
    serves it (None: an external backend does). A request without `model` is for the embedded
    model, or the one model the gateway serves."""
    engine = svc.registry.embedded
    if model is None:
        served = list(svc.registry.models())
        if engine is not None:
            model = engine.served_name
        elif len(served) == 1:
            model = served[0]
        else:
            raise GatewayError(
                400,
                "missing required parameter: model (this gateway serves several models)",
                code="missing_required_parameter",
                param="model",
            )
    names, _ = candidate_backends(svc.settings, svc.registry, model)
    if engine is None or engine.name not in names:
        return model, None
    if engine.model is None:
        what = "failed to load" if engine.load_error else "is still loading"
        raise GatewayError(503, f"the embedded model {what}", code="model_not_ready", retry_after=2)
    return model, engine.model


async def _answer(
    request: Request,
    svc: Services,
    model: type[R],
    work: Callable[[ModelInfo, R], dict[str, Any]],
    endpoint: Relayed,
) -> Response:
    req = await body.parse(request, model)
    name, info = _target(svc, req.model)
    if info is None:
        body_sent = req.model_dump(exclude_unset=True)
        return await relay(svc, request, body_sent, name, endpoint, f"/{endpoint}", root=True)
    if len(await request.body()) > OFF_LOOP_BYTES:  # read once already: Starlette keeps it
        return SafeJSONResponse(await asyncio.to_thread(work, info, req))
    return SafeJSONResponse(work(info, req))


@router.post("/tokenize", summary="Tokenize", openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request, svc: ServicesDep, _: ApiKeyDep) -> Response:
    return await _answer(request, svc, TokenizeRequest, embedded.tokenize, "tokenize")


@router.post("/detokenize", summary="Detokenize", openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request, svc: ServicesDep, _: ApiKeyDep) -> Response:
    return await _answer(request, svc, DetokenizeRequest, embedded.detokenize, "detokenize")
