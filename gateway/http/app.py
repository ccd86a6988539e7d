"""`create_app(settings)`: the gateway as an ASGI app; nothing is built at import time."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

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
    embeddings,
    health,
    inference,
    models,
    responses,
    tokenize,
)
from specgate.gateway.http.ui.dashboard_auth import DashboardAuth, admin_guard
from specgate.gateway.http.worker_header import WorkerHeader
from specgate.gateway.protocol.admin_schemas import PolicyPatch, RetrainRequest
from specgate.gateway.protocol.dashboard_schemas import SignIn
from specgate.gateway.protocol.passthrough_schemas import PASSTHROUGH_BODIES
from specgate.gateway.protocol.responses import ResponsesRequest
from specgate.gateway.protocol.schemas import ChatCompletionRequest, CompletionRequest
from specgate.gateway.services import Services
from specgate.gateway.settings import Settings
from specgate.gateway.telemetry.records import RecordSink
from specgate.gateway.telemetry.revocations import SessionRevocations
from specgate.gateway.worker_context import WorkerContext

logger = logging.getLogger("specgate.gateway")


def create_app(
    settings: Settings | None = None,
    *,
    cache_dir: str | None = None,
    sink: RecordSink | None = None,
    worker: WorkerContext | None = None,
) -> FastAPI:
    """`worker`: this app is one worker of `serve --workers N` (None: the only one)."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = Services.build(settings, cache_dir, sink, worker)
        app.state.services = services
        dashboard: DashboardAuth | None = app.state.dashboard
        if dashboard is not None and services.store is not None:
            dashboard.revocations = SessionRevocations(services.store.engine)
        elif dashboard is not None:
            logger.warning("telemetry is off: dashboard sign-outs last only while this gateway runs")
        await services.start()
        # What start-up built lives as long as the process: out of the collector's way, so a full
        # collection scans only what requests allocate (tens of ms less at the p99 of a proxy).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await services.close()

    # The API's own schema and its pages only where the operator wants them shown (`docs`).
    docs = {} if settings.docs else {"openapi_url": None, "docs_url": None}
    app = GatewayApp(
        title="specgate",
        version="0.1.0",
        lifespan=lifespan,
        redoc_url=None,
        default_response_class=SafeJSONResponse,
        **docs,
    )
    install_error_handlers(app)
    shared = worker.shared_limits if worker is not None else None
    # Wrong admin keys per address, counted once for the sign-in form and the bearer admin path.
    app.state.admin_guard = admin_guard(settings, shared)
    # The dashboard's session signer (None without an admin key).
    app.state.dashboard = DashboardAuth.build(settings, app.state.admin_guard, shared)
    # admin_policy_diff before admin_policy: /admin/policy/diff is a path of its own.
    routers = (models, health, admin_policy_diff, admin_policy, admin_ops, admin_timeseries)
    passthrough = (embeddings, tokenize)
    for module in (*routers, *passthrough, responses, admin_ui_session, admin_ui):
        app.include_router(module.router)
    raw = {op.path: openapi.operation(op.summary, op.operation_id, op.model) for op in inference.OPERATIONS}
    bodies: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, PolicyPatch, RetrainRequest]
    raw[responses.PATH] = openapi.operation(responses.SUMMARY, responses.OPERATION_ID, ResponsesRequest)
    openapi.install(app, [*bodies, SignIn, *PASSTHROUGH_BODIES, ResponsesRequest], raw)
    edge: dict[str, Any] = {
        "max_body_bytes": settings.max_body_bytes,
        "trusted_proxies": settings.trusted_proxies,
        "body_read_timeout": settings.connections.body_read_timeout,
        "body_timeout": settings.connections.body_timeout,
    }
    app.add_middleware(GatewayMiddleware, **edge)
    several = worker is not None and worker.workers > 1  # then say which one answered
    if several:
        app.add_middleware(WorkerHeader)
    for op in inference.OPERATIONS:
        fast: ASGIApp = GatewayMiddleware(inference.endpoint(op), **edge)
        app.fast_routes[op.path] = WorkerHeader(fast) if several else fast
    fast = GatewayMiddleware(responses.endpoint(), **edge)  # POST /v1/responses, as the chat route
    app.fast_routes[responses.PATH] = WorkerHeader(fast) if several else fast
    return app


class GatewayApp(FastAPI):
    """FastAPI, but for the inference routes, which go straight to their own middleware and handler
    (routes/inference.py): FastAPI's middleware stack, router and dependency injection cost a third
    of the gateway's CPU per proxied request, and those routes need none of them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes: dict[str, ASGIApp] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_routes.get(scope["path"]) if scope["type"] == "http" else None
        if fast is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self  # where the handlers find app.state, as under Starlette
        await fast(scope, receive, send)
