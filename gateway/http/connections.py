"""What one client connection may cost a worker process: uvicorn's httptools protocol, with a
deadline for each request head and a cap on open connections, per process and per client address.

uvicorn's own timer runs only between requests (keep-alive): a client that opens a connection and
sends half a request head, or nothing, holds a file descriptor for as long as it likes, and a few
hundred such connections leave nothing for anyone else. Here:

- the head deadline (`head_timeout`) runs from a connection's opening, and from the first byte of
  each later request on it, to the end of that request's head; past it the client gets a 408 (if
  it sent anything) and the connection is closed. Body reads have deadlines of their own
  (middleware.py): they are the app's to answer;
- at the cap (`max_connections` per process, `max_per_address` per client address; trusted proxies
  carry many clients and have only the first), the oldest connection of that scope that is idle
  between requests or still sending its head is closed to make room, so the newest client, who is
  sending its request now, is served; a connection busy with a request is never closed for another.
  Only when every connection is busy is the new one closed instead.

Addresses are the peer's (`auth.limit_key`: an IPv6 client's /64), since no head has been read yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specgate.gateway.http.auth import Network, is_trusted, limit_key, parse_networks
from specgate.gateway.settings import ConnectionSettings, Settings

logger = logging.getLogger("specgate.gateway")
FD_RESERVE = 128  # descriptors kept for the process itself: engine and telemetry sockets, files, logs


def _timeout_response() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "The request head was not received in time.",
                "type": "invalid_request_error",
                "param": None,
                "code": "request_timeout",
            }
        }
    ).encode()
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


TIMEOUT_RESPONSE = _timeout_response()


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(settings: ConnectionSettings, fd_limit: int) -> int:
    """Open client connections one process may hold: the configured cap, never more than its file
    descriptors allow after a reserve (a quarter of them, at least FD_RESERVE, at most 4096)."""
    reserve = min(4096, max(FD_RESERVE, fd_limit // 4))
    allowed = max(16, fd_limit - reserve)
    return min(allowed, settings.max_connections or 65_536)


class ConnectionGuard:
    """This process's open connections, by client address, and which of them may be closed to make
    room (idle between requests, or still sending a head), oldest first. Event loop only."""

    def __init__(
        self, settings: ConnectionSettings, trusted_proxies: list[Network], max_connections: int
    ) -> None:
        self.settings = settings
        self.trusted = trusted_proxies
        self.max_connections = max_connections
        self.open = 0
        self.per_address: dict[str, int] = {}
        self.evictable: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self.evictable_by_address: dict[str, OrderedDict[GuardedProtocol, None]] = {}
        self.evicted = 0  # closed to make room (for tests and logs)
        self.refused = 0  # closed at once: every connection of their scope was busy
        self.timed_out = 0  # heads that missed their deadline

    def capped(self, addr: str) -> bool:
        return not (self.trusted and is_trusted(addr, self.trusted))

    def admit(self, conn: GuardedProtocol) -> bool:
        """Count a new connection, making room if its scope is full; False: close it, no room."""
        addr = conn.address
        if self.capped(addr) and self.per_address.get(addr, 0) >= self.settings.max_per_address:
            room = self.evictable_by_address.get(addr)
            if not room:
                self.refused += 1
                return False
            self._evict(next(iter(room)))
        if self.open >= self.max_connections:
            if not self.evictable:
                self.refused += 1
                return False
            self._evict(next(iter(self.evictable)))
        self.open += 1
        self.per_address[addr] = self.per_address.get(addr, 0) + 1
        conn.counted = True
        return True

    def _evict(self, conn: GuardedProtocol) -> None:
        self.evicted += 1
        conn.close_now()

    def may_evict(self, conn: GuardedProtocol, yes: bool) -> None:
        addr = conn.address
        if yes:
            self.evictable[conn] = None
            self.evictable_by_address.setdefault(addr, OrderedDict())[conn] = None
            return
        self.evictable.pop(conn, None)
        room = self.evictable_by_address.get(addr)
        if room is not None:
            room.pop(conn, None)
            if not room:
                del self.evictable_by_address[addr]

    def forget(self, conn: GuardedProtocol) -> None:
        """The connection is closed (or being closed): it no longer counts."""
        self.may_evict(conn, False)
        if not conn.counted:
            return
        conn.counted = False
        self.open -= 1
        left = self.per_address.get(conn.address, 1) - 1
        if left > 0:
            self.per_address[conn.address] = left
        else:
            self.per_address.pop(conn.address, None)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under a `ConnectionGuard` (set on the class by `protocol_class`)."""

    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.address = "unknown"
        self.counted = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the current head so far (0: none yet)
        self._in_request = False  # between a head's end and its response's end

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = self.client[0] if self.client else "unknown"
        self.address = limit_key(peer) if self.guard.capped(peer) else peer
        if not self.guard.admit(self):
            transport.abort()
            return
        self._start_head()

    def _start_head(self) -> None:
        self._head_bytes = 0
        self._cancel_head()
        self._head_timer = self.loop.call_later(self.guard.settings.head_timeout, self._head_expired)
        self.guard.may_evict(self, True)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        if not self._in_request:
            if self._head_timer is None:  # the first byte of a request on a kept-alive connection
                self._start_head()
            self._head_bytes += len(data)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_head()
        self._in_request = True
        self.guard.may_evict(self, False)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        self._in_request = False
        if self.pipeline:
            return  # the next pipelined request starts now: still busy
        self.guard.may_evict(self, True)  # idle: uvicorn's keep-alive timer runs

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_request or self.transport.is_closing():
            return
        self.guard.timed_out += 1
        if self._head_bytes:
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()
        else:
            self.transport.abort()
        self.guard.forget(self)

    def close_now(self) -> None:
        """Closed to make room: at once, nothing more is read or written."""
        self._cancel_head()
        self.guard.forget(self)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self.guard.forget(self)
        super().connection_lost(exc)


def protocol_class(settings: ConnectionSettings, trusted_proxies: list[str]) -> type[GuardedProtocol]:
    """The protocol class for uvicorn's `http=` option: one guard for this process's connections."""
    limit = raise_fd_limit()
    cap = connection_cap(settings, limit)
    guard = ConnectionGuard(settings, parse_networks(trusted_proxies), cap)
    logger.debug(
        "connections: at most %d open, %d per address (file limit %d)", cap, settings.max_per_address, limit
    )
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})


def uvicorn_options(
    settings: Settings, *, verbose: bool = False, graceful_timeout: int = 10
) -> dict[str, Any]:
    """uvicorn's options for serving the gateway, wherever it is served from."""
    return {
        "http": protocol_class(settings.connections, settings.trusted_proxies),
        "log_level": "info" if verbose else "warning",
        "access_log": verbose,
        "timeout_graceful_shutdown": graceful_timeout,
        "timeout_keep_alive": settings.keep_alive_timeout,
        # X-Forwarded-For and -Proto are the gateway's to judge (settings.trusted_proxies): uvicorn
        # would trust them from any loopback peer, letting a local client pose as any address.
        "proxy_headers": False,
    }
