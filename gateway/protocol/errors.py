"""The one error type of the gateway: an OpenAI-shaped error with its HTTP status.

`{"error": {"message", "type", "param", "code"}}`. Any layer raises it (validation, routing,
backends); only the HTTP layer turns it into a response. `retryable` says whether another attempt
or another backend may succeed where this one failed (the failover loop reads it).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_RETRY_AFTER = 3600.0

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.retry_after = retry_after
        self.retryable = retryable

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        wait = self.retry_after
        if wait is None or not math.isfinite(wait):
            return {} if wait is None else {"retry-after": str(int(MAX_RETRY_AFTER))}
        return {"retry-after": str(int(min(MAX_RETRY_AFTER, max(1.0, round(wait)))))}

    def for_client(self, default_retry_after: float) -> GatewayError:
        """As the client gets it: 429 / 503 always carry a Retry-After, nothing else does."""
        waits = self.status in (429, 503)
        wait = (self.retry_after if self.retry_after is not None else default_retry_after) if waits else None
        return GatewayError(
            self.status, self.message, code=self.code, param=self.param, type=self.type, retry_after=wait
        )

    def sse_event(self) -> bytes:
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def invalid(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, param=param, code=code)
