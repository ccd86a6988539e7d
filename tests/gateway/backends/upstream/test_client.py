"""The upstream HTTP client against raw sockets: keep-alive, framing, retries only where safe, bounds."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Awaitable, Callable

import pytest

from specgate.gateway.backends.upstream.client import (
    DecodingError,
    PoolTimeout,
    Timeouts,
    TransportError,
    UpstreamClient,
)

T = Timeouts(connect=2.0, read=2.0)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


class RawServer:
    """A TCP server answering each request with what `handler` writes; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.requests = handler, 0, 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                while True:
                    await _read_request(reader)
                    self.requests += 1
                    if not await self.handler(reader, writer, self.requests):
                        break
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n" % (len(body), extra) + body


async def _body(client: UpstreamClient, url: str) -> tuple[int, bytes]:
    r = await client.send("POST", url, body=b'{"x":1}', timeout=T)
    try:
        return r.status_code, b"".join([p async for p in r.aiter_bytes()])
    finally:
        await r.aclose()


def test_keep_alive_serves_many_requests_on_one_connection() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(_ok(json.dumps({"n": n}).encode()))
        await w.drain()
        return True

    async def run() -> None:
        server = RawServer(handler)
        async with server as url:
            client = UpstreamClient()
            bodies = [await _body(client, url) for _ in range(5)]
            await client.aclose()
        assert [json.loads(b)["n"] for _, b in bodies] == [1, 2, 3, 4, 5]
        assert server.connections == 1

    asyncio.run(run())


def test_a_kept_alive_connection_the_upstream_closed_is_retried_once_on_a_new_one() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(_ok(b'{"ok":true}'))
        await w.drain()
        return False  # closes after each answer, though it did not say `connection: close`

    async def run() -> None:
        server = RawServer(handler)
        async with server as url:
            client = UpstreamClient()
            assert (await _body(client, url))[0] == 200
            await asyncio.sleep(0.05)  # the close reaches the client while the connection is idle...
            client._idle.conns[next(iter(client._idle.conns))][0].closed = False  # ...unnoticed
            assert (await _body(client, url))[0] == 200
            await client.aclose()
        assert server.connections == 2 and server.requests == 2

    asyncio.run(run())


def test_a_request_that_timed_out_is_not_sent_again() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n == 2:
            await asyncio.sleep(5)
        w.write(_ok(b"{}"))
        await w.drain()
        return True

    async def run() -> None:
        server = RawServer(handler)
        async with server as url:
            client = UpstreamClient()
            await _body(client, url)
            with pytest.raises(TransportError, match="no response"):
                await client.send("POST", url, body=b"{}", timeout=Timeouts(connect=1.0, read=0.3))
            await client.aclose()
        assert server.requests == 2

    asyncio.run(run())


@pytest.mark.parametrize("framing", ["chunked", "until-close"])
def test_bodies_framed_by_chunks_or_by_the_connection_closing(framing: str) -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if framing == "chunked":
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for part in (b'{"a":', b'"hello"}'):
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
            w.write(b"0\r\n\r\n")
            await w.drain()
            return True
        w.write(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"a":"hello"}')
        await w.drain()
        return False

    async def run() -> None:
        async with RawServer(handler) as url:
            client = UpstreamClient()
            for _ in range(2):
                status, body = await _body(client, url)
                assert status == 200 and json.loads(body) == {"a": "hello"}
            await client.aclose()

    asyncio.run(run())


def test_a_full_pool_waits_then_gives_up_and_hands_slots_on() -> None:
    gate = asyncio.Event()

    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        if n == 1:
            await gate.wait()
        w.write(_ok(b"{}"))
        await w.drain()
        return True

    async def run() -> None:
        async with RawServer(handler) as url:
            client = UpstreamClient(max_connections=1)
            holder = asyncio.create_task(_body(client, url))
            await asyncio.sleep(0.1)
            with pytest.raises(PoolTimeout):
                await client.send("POST", url, body=b"{}", timeout=Timeouts(connect=0.2, read=1.0))
            waiter = asyncio.create_task(_body(client, url))
            await asyncio.sleep(0.05)
            gate.set()
            assert (await holder)[0] == 200 and (await waiter)[0] == 200
            await client.aclose()

    asyncio.run(run())


def test_gzip_is_decoded_in_bounded_pieces_and_garbage_is_a_decoding_error() -> None:
    big = gzip.compress(b"a" * (8 << 20))  # 8 MiB in a few KiB

    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(_ok(big if n == 1 else b"not gzip", b"content-encoding: gzip\r\n"))
        await w.drain()
        return True

    async def run() -> None:
        async with RawServer(handler) as url:
            client = UpstreamClient()
            r = await client.send("POST", url, body=b"{}", timeout=T)
            sizes = [len(p) async for p in r.aiter_bytes()]
            await r.aclose()
            assert sum(sizes) == 8 << 20 and max(sizes) <= 1 << 16
            r = await client.send("POST", url, body=b"{}", timeout=T)
            with pytest.raises(DecodingError):
                _ = [p async for p in r.aiter_bytes()]
            await r.aclose()
            await client.aclose()

    asyncio.run(run())


def test_refused_connections_and_non_http_answers_are_transport_errors() -> None:
    async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> bool:
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await w.drain()
        return False

    async def run() -> None:
        client = UpstreamClient()
        with pytest.raises(TransportError):
            await client.send("POST", "http://127.0.0.1:9/v1/x", body=b"{}", timeout=T)
        async with RawServer(handler) as url:
            with pytest.raises(TransportError):
                await client.send("POST", url, body=b"{}", timeout=T)
        with pytest.raises(TransportError, match="line break"):
            await client.send("GET", url, headers={"x-evil": "a\r\nhost: elsewhere"}, timeout=T)
        assert client._slots.free == client.max_connections  # every failure gave its slot back
        await client.aclose()

    asyncio.run(run())


def test_an_origin_behind_a_proxy_goes_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY is honoured (NO_PROXY too): such origins take aiohttp's proxy support."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await _read_request(reader)
        seen.append(request.split(b"\r\n", 1)[0])
        writer.write(_ok(b'{"via":"proxy"}'))
        await writer.drain()
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("NO_PROXY", "localhost")
        client = UpstreamClient()
        status, body = await _body(client, "http://upstream.example:8000/v1/chat/completions")
        await client.aclose()
        server.close()
        assert status == 200 and json.loads(body) == {"via": "proxy"}
        assert seen == [b"POST http://upstream.example:8000/v1/chat/completions HTTP/1.1"]
        assert client._target("http://localhost:8000/v1/x").proxy is None

    asyncio.run(run())
