"""Noticing a client that went away, streaming or not, so its backend work stops at once.

Starlette does not cancel a handler when its client disconnects, and a stream only notices at its
next write. Here a watcher waits for `http.disconnect` beside the work and cancels the work when it
comes: the embedded engine then aborts the request and frees its KV blocks within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from specgate.gateway.protocol import json_codec

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


async def wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """The work's result, or ClientDisconnected (the work cancelled) if the client leaves first.

    The work runs in the calling task and a watcher task cancels it: one task per request, not two
    and an `asyncio.wait` (which showed in the gateway's profile under load)."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await wait_disconnect(request.receive)
        left = True
        task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        # Our own cancel, and nobody else's (a server shutting down cancels too): the client left.
        if left and task.uncancel() == 0:
            raise ClientDisconnected() from None
        raise
    finally:
        watcher.cancel()


class EventStreamResponse(Response):
    """An SSE response whose producer is cancelled the moment the client disconnects."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        # Response.__init__ would render a body and a content-length; a stream has neither.
        self.events = events
        # Runs once the response is over however it ended, even if the producer never started
        # (a generator that never ran has no `finally` of its own to run).
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.stream_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not producer.done():
                producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
            if self.on_close is not None:
                await self.on_close()

    async def _produce(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.stream_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            pass
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


# Characters JSON leaves raw but line readers split on (Python's str.splitlines, and httpx's
# iter_lines with it): raw in a `data:` line they would cut an event in two. In JSON text they can
# only stand inside strings, and UTF-8 never holds their bytes inside another character, so the
# bytes are replaced by their escapes.
_LINE_BREAKING = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse(obj: Any) -> bytes:
    data = json_codec.encode(obj)
    for raw, escaped in _LINE_BREAKING:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


DONE = b"data: [DONE]\n\n"
