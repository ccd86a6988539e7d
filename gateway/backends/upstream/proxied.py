"""Origins behind an HTTP(S) proxy: aiohttp, which speaks proxies, under the same bounds.

Few deployments route their inference backends through a proxy, so this path favours completeness
over speed: the lean connections of `http1.py` serve every direct origin.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from specgate.gateway.backends.upstream.body_decoding import ACCEPT_ENCODING
from specgate.gateway.backends.upstream.errors import TransportError
from specgate.gateway.backends.upstream.pool import KEEPALIVE_SECONDS


class ProxiedBody:
    def __init__(self, raw: aiohttp.ClientResponse) -> None:
        self.raw = raw
        self._parts: AsyncIterator[bytes] | None = None

    async def read(self) -> bytes | None:
        if self._parts is None:
            self._parts = aiter(self.raw.content.iter_any())
        try:
            return await anext(self._parts)
        except StopAsyncIteration:
            return None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    def finish(self) -> None:
        self.raw.release() if self.raw.content.at_eof() else self.raw.close()


class ProxiedSession:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def request(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: Any,
        proxy: str,
    ) -> tuple[int, dict[str, str], ProxiedBody]:
        if self._session is None:  # built on first use, inside the event loop that runs it
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS),
                auto_decompress=False,  # decoded in bounded pieces by the caller
                skip_auto_headers=("User-Agent",),
            )
        sent = {"accept-encoding": ACCEPT_ENCODING, **(headers or {})}
        if body is not None:
            sent.setdefault("content-type", "application/json")
        try:
            raw = await self._session.request(
                method,
                url,
                data=body,
                headers=sent,
                allow_redirects=False,
                proxy=proxy,
                timeout=aiohttp.ClientTimeout(sock_connect=timeout.connect, sock_read=timeout.read),
            )
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc
        return raw.status, {k.lower(): v for k, v in raw.headers.items()}, ProxiedBody(raw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
