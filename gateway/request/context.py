"""Who is asking, fixed once at the edge: the gateway's ids for the request, and the caller."""

from __future__ import annotations

from dataclasses import dataclass

from specgate.gateway.backends.base import Endpoint
from specgate.gateway.backends.relay import Relayed


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Made by the middleware before anything can fail."""

    request_id: str  # the gateway's own id (random), the row's key
    # The client's own x-request-id, kept as sent (it may repeat); never used as a key.
    client_request_id: str | None
    endpoint: Endpoint | Relayed  # chat, completion, responses, or a pass-through (embeddings, rerank)
    arrival_time: float  # unix seconds
    arrival_perf: float  # time.perf_counter() at arrival: the gateway's own overhead is timed from it
    client_addr: str
    client_bucket: str  # the address as rate limits count it (an IPv6 client's /64)

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("a request needs an id")


@dataclass(frozen=True, slots=True)
class Caller:
    """Whom the request is for, once its key and rate limit are checked."""

    key_id: str | None  # a hash prefix of the API key, never the key; None without one
    # Whose limits and fair share apply: the key's id, or `addr:<bucket>` in open mode.
    tenant: str
