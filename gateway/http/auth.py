"""Bearer API keys for /v1 and a separate admin key for /admin, rate limits, and client addresses.

Keys are compared in constant time and never logged; a request is identified in records by a keyed
fingerprint of its key (keyring.KeyIds: an HMAC under the gateway's secret). Limits key on what a
client cannot mint at will: a valid key, else the client's address (a bearer string in open mode is
free to invent, so it never keys a limit). X-Forwarded-For and X-Forwarded-Proto are believed only
when the peer is a configured trusted proxy.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from specgate.gateway.protocol.errors import GatewayError


def bearer_token(request: Request) -> str | None:
    return bearer(request.headers.get("authorization", ""))


def bearer(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, else None."""
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


def is_trusted(addr: str, networks: list[Network]) -> bool:
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
    if not networks or not is_trusted(peer, networks):
        return peer
    forwarded = headers.get(b"x-forwarded-for", b"").decode("latin-1")
    for hop in reversed([h.strip() for h in forwarded.split(",") if h.strip()][-32:]):
        if not is_trusted(hop, networks):
            try:
                return str(ipaddress.ip_address(hop))
            except ValueError:
                return peer  # garbage from a trusted hop's client: fall back to what we know
    return peer


def forwarded_scheme(
    scope: Mapping[str, Any], headers: Mapping[bytes, bytes], networks: list[Network]
) -> str | None:
    """The scheme the client used, as a trusted proxy in front says (X-Forwarded-Proto: its last
    entry, the one the nearest proxy wrote); None when the peer is not a trusted proxy or says
    nothing usable."""
    client = scope.get("client")
    if not client or not is_trusted(str(client[0]), networks):
        return None
    raw = headers.get(b"x-forwarded-proto", b"").decode("latin-1")
    last = raw.rsplit(",", 1)[-1].strip().lower()
    return last if last in ("http", "https") else None


@functools.lru_cache(maxsize=4096)  # parsing an address costs more than the rest of the check
def limit_key(addr: str) -> str:
    """The rate-limit bucket of an address: itself for IPv4, its /64 for IPv6 (one client holds a
    whole /64 and could rotate through it)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    if ip.version == 6 and ip.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip.ipv4_mapped) if ip.version == 6 and ip.ipv4_mapped else str(ip)
