"""Bearer API keys for /v1 and a separate admin key for /admin, rate limits, and client addresses.

Keys are compared in constant time and never logged; a request is identified in records by a short
hash of its key. Limits key on what a client cannot mint at will: a valid key, else the client's
address (a bearer string in open mode is free to invent, so it never keys a limit). X-Forwarded-For
is believed only when the peer is a configured trusted proxy.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from specgate.gateway.protocol.errors import GatewayError

MAX_BUCKETS = 65_536  # limiter state is bounded: least recently seen keys are forgotten first


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_key(presented: str | None, accepted: list[str]) -> bool:
    if presented is None:
        return False
    ok = False
    raw = presented.encode("utf-8", "surrogatepass")
    for key in accepted:  # no early exit: the time taken does not depend on which key matched
        ok |= hmac.compare_digest(raw, key.encode())
    return ok


def unauthorized(message: str = "Incorrect API key provided.") -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: list[str]) -> list[Network]:
    """Trusted proxies as networks: "10.0.0.5", "10.0.0.0/8", "::1"."""
    return [ipaddress.ip_network(e.strip(), strict=False) for e in entries]


def _trusted(addr: str, networks: list[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return False
    return any(ip in n for n in networks)


def client_address(scope: Mapping[str, Any], headers: Mapping[bytes, bytes], networks: list[Network]) -> str:
    """The client's address: the peer, or, when the peer is a trusted proxy, the nearest address in
    X-Forwarded-For that is not itself a trusted proxy (earlier entries are the client's to forge)."""
    client = scope.get("client")
    peer = str(client[0]) if client else "unknown"
    if not networks or not _trusted(peer, networks):
        return peer
    forwarded = headers.get(b"x-forwarded-for", b"").decode("latin-1")
    for hop in reversed([h.strip() for h in forwarded.split(",") if h.strip()][-32:]):
        if not _trusted(hop, networks):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return peer  # garbage from a trusted hop's client: fall back to what we know
    return peer


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per key: `rpm` requests per minute, bursts up to `rpm` / 6 (ten seconds' worth).

    At most `max_keys` buckets are kept; the least recently used go first (a forgotten key starts
    again with a full bucket, which costs an attacker as many addresses as it saves)."""

    rpm: int
    max_keys: int = MAX_BUCKETS
    buckets: OrderedDict[str, _Bucket] = field(default_factory=OrderedDict)

    @property
    def rate(self) -> float:
        return self.rpm / 60.0

    @property
    def burst(self) -> float:
        return max(1.0, self.rpm / 6.0)

    def _bucket(self, key: str, now: float) -> _Bucket:
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(self.burst, now)
            while len(self.buckets) > self.max_keys:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(key)
        b.tokens = min(self.burst, b.tokens + (now - b.updated) * self.rate)
        b.updated = now
        return b

    def take(self, key: str, now: float | None = None) -> float:
        """Spend one token; 0.0 if there was one, else the seconds until there will be."""
        if self.rpm <= 0:
            return 0.0
        b = self._bucket(key, time.monotonic() if now is None else now)
        if b.tokens < 1.0:
            return math.ceil((1.0 - b.tokens) / self.rate)
        b.tokens -= 1.0
        return 0.0

    def check(self, key: str, now: float | None = None) -> None:
        wait = self.take(key, now)
        if wait:
            raise GatewayError(
                429,
                f"Rate limit reached: {self.rpm} requests per minute.",
                code="rate_limit_exceeded",
                retry_after=wait,
            )


@dataclass(slots=True)
class RefusalBudget:
    """Refused requests (401, 413) per client address: once an address has spent its budget, every
    request from it is answered 429 until the bucket refills, before its key or body is looked at."""

    limiter: RateLimiter

    def exhausted(self, addr: str, now: float | None = None) -> bool:
        if self.limiter.rpm <= 0:
            return False
        b = self.limiter.buckets.get(addr)
        if b is None:
            return False
        now = time.monotonic() if now is None else now
        return min(self.limiter.burst, b.tokens + (now - b.updated) * self.limiter.rate) < 1.0

    def retry_after(self, addr: str) -> float:
        b = self.limiter.buckets.get(addr)
        if b is None or self.limiter.rpm <= 0:
            return 1.0
        return max(1.0, math.ceil((1.0 - b.tokens) / self.limiter.rate))

    def charge(self, addr: str) -> None:
        self.limiter.take(addr)
