"""Errors the engine raises for requests it cannot take; the gateway maps them to HTTP statuses."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine rejects as given (an HTTP 400 at the edge)."""

    code = "invalid_request"


class ContextLengthExceededError(RequestError):
    code = "context_length_exceeded"


class DuplicateRequestError(RequestError):
    code = "duplicate_request_id"
