"""A JSON response that can always be encoded.

Text that came from a client or an upstream (a model name, an upstream's answer) may hold lone
UTF-16 surrogates, which UTF-8 cannot encode: Starlette's JSONResponse would then fail while
rendering, after the handler had finished. Such bodies fall back to ASCII escapes (the encoding is
`protocol.json_codec.encode`, shared with SSE events and upstream payloads), which are
valid JSON for any string.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from specgate.gateway.protocol import json_codec


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json_codec.encode(content)
