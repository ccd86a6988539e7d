"""A JSON response that can always be encoded.

Text that came from a client or an upstream (a model name, an upstream's answer) may hold lone
UTF-16 surrogates, which UTF-8 cannot encode: Starlette's JSONResponse would then fail while
rendering, after the handler had finished. Such bodies fall back to ASCII escapes, which are
valid JSON for any string.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from specgate.gateway.protocol import json_codec


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        fast = json_codec.dumps(content)
        if fast is not None:
            return fast
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:  # NaN / Infinity from an upstream: null is the nearest valid JSON
            return json.dumps(finite(content), ensure_ascii=True, separators=(",", ":")).encode()


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
