"""Reading a JSON request body at the edge: one parse, bounded, and a 400 that names the parameter.

The body's size is already bounded by the middleware and the key already checked by the route's
dependencies when this runs. What JSON allows but a request never may is refused here: NaN and
Infinity literals, nesting deeper than `MAX_DEPTH`, strings holding lone UTF-16 surrogates (they
cannot be encoded again: one such model name would break /metrics and the telemetry writer).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from specgate.gateway.http.errors import invalid, validation_error
from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.nesting import MAX_DEPTH, text_nests_deeper
from specgate.gateway.request.tracker import RequestTracker

M = TypeVar("M", bound=BaseModel)
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_NOT_JSON = "the request body is not valid JSON"
OFF_LOOP_BYTES = 64 * 1024  # bodies above this are parsed and validated in a worker thread


class _BadNumber(ValueError):
    """A number JSON's grammar allows (or NaN / Infinity, which it does not) that no float holds."""


def _no_constants(name: str) -> Any:
    raise _BadNumber(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        shown = text if len(text) <= 32 else f"{text[:16]}...{text[-8:]}"
        raise _BadNumber(f"the number {shown} is out of range")
    return value


def loads(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a GatewayError (400) saying what is wrong with it."""
    data = json_codec.loads(raw)  # where it decides: valid UTF-8, no NaN, no lone surrogate
    text = None
    if data is json_codec.UNDECIDED:
        text, data = _stdlib_loads(raw)
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", code="invalid_json")
    if text_nests_deeper(raw, data, MAX_DEPTH):
        raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    if text is not None and _ESCAPED_SURROGATE.search(text) is not None:
        _check_text(data)  # only with such an escape can a string hold a lone surrogate
    return data


def _stdlib_loads(raw: bytes) -> tuple[str, Any]:
    try:
        # UTF-8 only (RFC 8259): json.loads would also guess UTF-16 / UTF-32 from bytes.
        text = raw.decode("utf-8")
        data = json.loads(text, parse_constant=_no_constants, parse_float=_finite)
    except RecursionError:
        raise invalid(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except UnicodeDecodeError as exc:
        raise invalid(f"{_NOT_JSON}: it is not UTF-8 (byte {exc.start})", code="invalid_json") from None
    except json.JSONDecodeError as exc:  # says where, never what: no echo of the body
        where = f"line {exc.lineno}, column {exc.colno}"
        raise invalid(f"{_NOT_JSON}: {exc.msg.lower()} ({where})", code="invalid_json") from None
    except _BadNumber as exc:
        raise invalid(f"{_NOT_JSON}: {exc}", code="invalid_json") from None
    except ValueError:  # Python's limit on the digits of an integer
        raise invalid(f"{_NOT_JSON}: a number has too many digits", code="invalid_json") from None
    return text, data


def _check_text(root: Any) -> None:
    """Every key and string in the body is valid Unicode (no lone surrogate), without recursion."""
    stack: list[Any] = [root]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            _text(node)
        elif isinstance(node, dict):
            for key in node:
                _text(key)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _text(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(
            "the request body holds a string that is not valid Unicode (a lone surrogate escape)",
            code="invalid_json",
        ) from None


def validate(model: type[M], data: dict[str, Any], status: int = 400) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = validation_error(exc.errors(include_url=False, include_input=False))
        error.status = status
        raise error from None


async def parse_admin(request: Request, model: type[M], optional: bool = False) -> M:
    """An admin body: the same checks, in FastAPI's dialect (422 for an invalid field)."""
    raw = await request.body()
    if optional and not raw.strip():
        return model()
    return validate(model, loads(raw), status=422)


async def parse(request: Request, model: type[M], tracker: RequestTracker | None = None) -> M:
    """Read, parse and validate the body; the request's tracker learns its size and the model it
    names before validation can refuse it. A large body is parsed and validated in a thread (orjson
    and pydantic hold the GIL, but a thread lets the event loop in every switch interval; on the
    loop, a 4 MiB body of token ids would stall it for the whole parse)."""
    raw = await request.body()
    if len(raw) > OFF_LOOP_BYTES:
        result: M = await asyncio.to_thread(_parse_raw, raw, model, tracker)
        return result
    return _parse_raw(raw, model, tracker)


def _parse_raw(raw: bytes, model: type[M], tracker: RequestTracker | None) -> M:
    data = loads(raw)
    if tracker is not None:
        tracker.asked(data.get("model"), len(raw))
    return validate(model, data)
