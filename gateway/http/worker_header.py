"""`x-specgate-worker`: which worker process of `serve --workers N` answered (its pid).

Only with several workers: it tells an operator (and the tests) where a response came from, e.g. to
find the worker's log lines; a single-process gateway sends nothing new.
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-specgate-worker"


class WorkerHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.value = str(os.getpid()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)
