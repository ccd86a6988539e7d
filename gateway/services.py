"""What the endpoints share, built once per app in its lifespan (no import-time singletons)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.auth import RateLimiter
from gateway.metrics import Metrics
from gateway.records import MemorySink, RecordSink
from gateway.registry import BackendRegistry
from gateway.routing import Router, StaticRouter
from gateway.settings import Settings

logger = logging.getLogger("specgate.gateway")

ReadinessCheck = Callable[[], Awaitable[tuple[bool, str]]]


@dataclass
class Services:
    settings: Settings
    client: httpx.AsyncClient
    registry: BackendRegistry
    router: Router
    metrics: Metrics
    sink: RecordSink
    limiter: RateLimiter
    # Extra readiness checks by name (the telemetry store adds "store").
    readiness: dict[str, ReadinessCheck] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    _refresher: asyncio.Task[None] | None = None
    _hook: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, settings: Settings, cache_dir: str | None, sink: RecordSink | None = None) -> Services:
        # One pooled client for every external backend; per-backend timeouts are set per request.
        client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))
        registry = BackendRegistry.from_settings(settings, client, cache_dir)
        return cls(
            settings=settings,
            client=client,
            registry=registry,
            router=StaticRouter(settings, registry),
            metrics=Metrics(),
            sink=sink or MemorySink(),
            limiter=RateLimiter(settings.rate_limit_rpm),
        )

    async def start(self) -> None:
        await self.registry.start()
        embedded = self.registry.embedded
        if embedded is not None:
            embedded_ready = embedded.wait_ready

            async def hook() -> None:
                await embedded_ready()
                if embedded.worker is not None:
                    embedded.worker.on_step = self._on_step

            self._hook = asyncio.create_task(hook())
        self._refresher = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await self.registry.close()
        await self.client.aclose()

    def _on_step(self, load: Any) -> None:
        self.metrics.queue_depth.set(load.num_waiting)
        self.metrics.batch_size.set(load.num_running)
        self.metrics.kv_usage.set(load.kv_usage)

    async def _refresh_loop(self) -> None:
        while True:
            self.metrics.refresh_backends(self.registry.status())
            await asyncio.sleep(1.0)

    def load_snapshot(self) -> dict[str, Any]:
        """The load at a request's arrival, recorded with it (the policy learns from it)."""
        out: dict[str, Any] = {}
        embedded = self.registry.embedded
        if embedded is not None and embedded.worker is not None:
            w = embedded.worker
            out.update(
                queue_depth=w.num_waiting, running=w.load.num_running, kv_usage=round(w.load.kv_usage, 4)
            )
        out["backend_in_flight"] = {b.name: getattr(b, "in_flight", 0) for b in self.registry}
        return out
