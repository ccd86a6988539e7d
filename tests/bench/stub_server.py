"""The stub server on uvicorn in a thread of the test process: `with ThreadServer(config) as s`."""

from __future__ import annotations

import contextlib

from specgate.bench import launch
from specgate.bench.stub import PoolConfig, StubPoolApp


class ThreadServer:
    def __init__(self, config: PoolConfig) -> None:
        self.app = StubPoolApp(config)
        self.pool = self.app.pool
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ThreadServer:
        self.url = self._stack.enter_context(launch.in_process(self.app, "/health", timeout=30))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
