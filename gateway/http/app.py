"""`create_app(settings)`: the gateway as an ASGI app; nothing is built at import time."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from specgate.gateway.http import openapi
from specgate.gateway.http.errors import install_error_handlers
from specgate.gateway.http.middleware import GatewayMiddleware
from specgate.gateway.http.responses import SafeJSONResponse
from specgate.gateway.http.routes import (
    admin_ops,
    admin_policy,
    admin_policy_diff,
    admin_timeseries,
    admin_ui,
    admin_ui_session,
    health,
    inference,
    models,
)
from specgate.gateway.http.ui.dashboard_auth import DashboardAuth
from specgate.gateway.protocol.admin_schemas import PolicyPatch, RetrainRequest
from specgate.gateway.protocol.dashboard_schemas import SignIn
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.services import Services
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.records import RecordSink

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
    # The dashboard's session signer and sign-in guard (None without an admin key).
    app.state.dashboard = DashboardAuth.build(settings)
    # admin_policy_diff before admin_policy: /admin/policy/diff is a path of its own.
    routers = (inference, models, health, admin_policy_diff, admin_policy, admin_ops, admin_timeseries)
    for module in (*routers, admin_ui_session, admin_ui):
        app.include_router(module.router)
    openapi.install(app, [ChatCompletionRequest, CompletionRequest, PolicyPatch, RetrainRequest, SignIn])
    app.add_middleware(
        GatewayMiddleware, max_body_bytes=settings.max_body_bytes, trusted_proxies=settings.trusted_proxies
    )
    return app
