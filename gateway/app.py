"""`create_app(settings)`: the gateway as an ASGI app; nothing is built at import time."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import openapi
from gateway.admin_schemas import PolicyPatch, RetrainRequest
from gateway.api import admin_ops, admin_policy, chat, completions, health, models
from gateway.errors import install_error_handlers
from gateway.middleware import GatewayMiddleware
from gateway.records import RecordSink
from gateway.responses import SafeJSONResponse
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.services import Services
from gateway.settings import Settings

logger = logging.getLogger("specgate.gateway")


def create_app(
    settings: Settings | None = None, *, cache_dir: str | None = None, sink: RecordSink | None = None
) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, cache_dir, sink)
        app.state.services = services
        await services.start()
        try:
            yield
        finally:
            await services.close()

    app = FastAPI(
        title="specgate",
        version="0.1.0",
        lifespan=lifespan,
        redoc_url=None,
        default_response_class=SafeJSONResponse,
    )
    install_error_handlers(app)
    for module in (chat, completions, models, health, admin_policy, admin_ops):
        app.include_router(module.router)
    openapi.install(app, [ChatCompletionRequest, CompletionRequest, PolicyPatch, RetrainRequest])
    app.add_middleware(
        GatewayMiddleware, max_body_bytes=settings.max_body_bytes, trusted_proxies=settings.trusted_proxies
    )
    return app
