"""How a call to an upstream fails, in the gateway's terms (whichever HTTP client made it)."""

from __future__ import annotations


class TransportError(Exception):
    """The connection to the upstream failed: refused, reset, timed out, or not HTTP."""


class PoolTimeout(Exception):
    """The gateway's own connection pool had no free slot within the connect timeout."""


class DecodingError(Exception):
    """The body does not decode by its content-encoding."""
