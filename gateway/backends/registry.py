"""The backends this gateway knows, in configured order, and which of them serve which model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from specgate.gateway.backends.base import Backend
from specgate.gateway.backends.embedded.backend import EmbeddedBackend
from specgate.gateway.backends.upstream.backend import OpenAIBackend
from specgate.gateway.backends.upstream.client import UpstreamClient
from specgate.gateway.limits.limiters import Concurrency
from specgate.gateway.settings import Settings
from specgate.policies.load import BackendLoad

logger = logging.getLogger("specgate.gateway")


class BackendRegistry:
    def __init__(self, backends: list[Backend]) -> None:
        self._backends = {b.name: b for b in backends}
        # Replica groups (one routing arm each): group -> its members in configured order.
        self.groups: dict[str, list[str]] = {}
        for b in backends:
            if isinstance(b, OpenAIBackend) and b.settings.replica_group is not None:
                self.groups.setdefault(b.settings.replica_group, []).append(b.name)
        self.group_of = {name: g for g, names in self.groups.items() for name in names}
        # At most one in-process engine; looked up on every request, so found once here.
        self.embedded: EmbeddedBackend | None = next(
            (b for b in backends if isinstance(b, EmbeddedBackend)), None
        )

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        client: UpstreamClient,
        cache_dir: str | None,
        engine_socket: str | None = None,
        in_flight: Concurrency | None = None,
    ) -> BackendRegistry:
        """`engine_socket`: the shared engine core of `serve --workers N` (None: this gateway's own);
        `in_flight`: the workers' shared in-flight counts (None: this process counts alone)."""
        backends: list[Backend] = []
        if settings.embedded.enabled:
            backends.append(EmbeddedBackend(settings.embedded, cache_dir, engine_socket))
        backends.extend(OpenAIBackend(b, client, in_flight) for b in settings.backends)
        return cls(backends)

    def __iter__(self) -> Iterator[Backend]:
        return iter(self._backends.values())

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def serving(self, model: str) -> list[Backend]:
        return [b for b in self._backends.values() if model in b.model_ids()]

    def models(self) -> dict[str, list[str]]:
        """Every public model name, with the backends that serve it."""
        out: dict[str, list[str]] = {}
        for b in self._backends.values():
            for m in b.model_ids():
                out.setdefault(m, []).append(b.name)
        return out

    def loads(self) -> dict[str, BackendLoad]:
        """Every backend's load, and each replica group's as one arm's (routing/router.py)."""
        out = {b.name: b.load() for b in self._backends.values()}
        for group, members in self.groups.items():
            out[group] = BackendLoad.combine([out[m] for m in members])
        return out

    def pool_speculation(self, name: str) -> str | None:
        """How a backend or replica group speculates (the first member that says so)."""
        members = self.groups.get(name, [name])
        for m in members:
            b = self._backends.get(m)
            if isinstance(b, OpenAIBackend) and b.speculation is not None:
                return b.speculation
        return None

    def status(self) -> dict[str, Any]:
        return {b.name: b.status() for b in self._backends.values()}

    async def start(self) -> None:
        await asyncio.gather(*(b.start() for b in self._backends.values()))

    async def close(self) -> None:
        for b in self._backends.values():
            try:
                await b.close()
            except Exception:
                logger.exception("closing backend %s failed", b.name)
