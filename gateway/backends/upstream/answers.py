"""Reading an OpenAI-compatible upstream's answers without trusting them.

Bodies are read up to a size limit after their content-encoding (a compressed bomb is capped too);
event streams are split into `data:` payloads here, with every line and event bounded; a body must be
a JSON object of the OpenAI shape with believable usage counts; an error body becomes an
OpenAI-shaped `GatewayError` with the upstream's status, message and Retry-After (finite, capped);
listed model ids are kept only if they could be ours. Whatever breaks the protocol raises
`Malformed`, which the backend turns into a 502 (failing over while nothing reached the client).
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from specgate.gateway.backends.upstream.client import DecodingError, TransportError, UpstreamResponse
from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.errors import GatewayError
from specgate.gateway.protocol.nesting import MAX_DEPTH, text_nests_deeper

MAX_RETRY_AFTER = 3600.0
MAX_MESSAGE = 1000  # an upstream's error message is cut here (for the log)
MAX_CLIENT_MESSAGE = 300  # what of it a client may see (a 4xx: what was wrong with the request)
MAX_SERVER_MESSAGE = 120  # of a 5xx: a short reason ("overloaded"), never a dump
_WORD = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PARAM = re.compile(r"^[A-Za-z0-9_.\[\]\-]{1,200}$")
# What an upstream's insides look like: tracebacks, exception names, source paths, memory addresses,
# network addresses and internal host names.
_INTERNAL = re.compile(
    r"Traceback|File \"|\b\w+(?:Error|Exception)\b:|\b0x[0-9a-f]{6,}"
    r"|(?:^|[\s'\"(=])/(?:home|usr|opt|var|root|tmp|srv|app|mnt)/"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b|\.(?:internal|local|lan|cluster)\b|\bpid \d+",
    re.I,
)
MAX_USAGE = 2**31 - 1
MAX_MODEL_ID = 256
MAX_MODELS = 1024  # model ids taken from one upstream's listing


logger = logging.getLogger("specgate.upstream")


def client_message(status: int, message: str, name: str) -> str:
    """What of an upstream's error message a client is shown: its first line, printable and cut
    short (a 4xx says what was wrong with the request, which the client needs; a 5xx may give a
    short reason). A message that looks like the upstream's insides (a traceback, an exception, a
    path, an address or host) is replaced by a plain statement; the log keeps the original."""
    line = "".join(c for c in message.split("\n", 1)[0] if c.isprintable()).strip()
    plain = f"backend {name} answered {status}"
    if not line or _INTERNAL.search(line) or (status >= 500 and len(line) > MAX_SERVER_MESSAGE):
        return plain
    return line if len(line) <= MAX_CLIENT_MESSAGE else line[: MAX_CLIENT_MESSAGE - 3] + "..."


class Malformed(Exception):
    """The upstream's body or stream broke the protocol; becomes a 502."""


async def read_capped(response: UpstreamResponse, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for part in decoded(response):  # decoded: a compressed bomb is capped too
        size += len(part)
        if size > limit:
            raise Malformed(f"sent a body over {limit} bytes")
        parts.append(part)
    return b"".join(parts)


async def decoded(response: UpstreamResponse) -> AsyncIterator[bytes]:
    """The body's bytes after its content-encoding; one that does not decode is a protocol error."""
    try:
        async for part in response.aiter_bytes():
            yield part
    except DecodingError:
        raise Malformed("sent a body its content-encoding does not decode") from None


def json_object(raw: bytes | str, content_type: str, whole: bool = True) -> dict[str, Any]:
    """An upstream body as a JSON object of the OpenAI shape, or Malformed. Usage counts that
    cannot be true fail a whole body (`whole`: nothing reached the client, another backend may
    answer); in a stream's last chunk, after the text went out, they are only dropped."""
    body = json_codec.loads(raw)
    try:
        if body is json_codec.UNDECIDED:
            body = json.loads(raw, parse_constant=lambda _: None)  # NaN / Infinity: no number at all
    except (ValueError, UnicodeDecodeError, RecursionError):
        kind = f" ({content_type[:64]})" if content_type and "json" not in content_type else ""
        raise Malformed(f"sent a body that is not JSON{kind}") from None
    if not isinstance(body, dict):
        raise Malformed("sent JSON that is not an object")
    if text_nests_deeper(raw, body, MAX_DEPTH):
        raise Malformed(f"sent JSON nested deeper than {MAX_DEPTH} levels")
    choices = body.get("choices")
    if choices is not None and (
        not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices)
    ):
        raise Malformed("sent choices that are not a list of objects")
    usage = body.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise Malformed("sent a usage that is not an object")
    if isinstance(usage, dict):
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            value = usage.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_USAGE
            ):
                if whole:
                    raise Malformed(f"sent an impossible usage.{key}")
                usage[key] = None  # a count we cannot believe is no count
        fit_prompt_details(usage)
    return body


def fit_prompt_details(usage: dict[str, Any]) -> None:
    """`prompt_tokens_details` is an optional detail: one that cannot be true (not an object, a
    cached count that is not a count or exceeds the prompt) is dropped, and never costs the answer."""
    details = usage.get("prompt_tokens_details")
    if details is None:
        return
    if not isinstance(details, dict):
        usage["prompt_tokens_details"] = None
        return
    cached, prompt = details.get("cached_tokens"), usage.get("prompt_tokens")
    if cached is None:
        return
    count = isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= MAX_USAGE
    known_prompt = isinstance(prompt, int) and not isinstance(prompt, bool)
    if not count or (known_prompt and cached > prompt):
        details["cached_tokens"] = None


def relayable(data: str, chunk: dict[str, Any]) -> bool:
    """Whether an event's own text may go to the client as it came: one line, no usage (whose
    counts `json_object` may have cut), and no NaN / Infinity (which it turned into null)."""
    return "usage" not in chunk and "\n" not in data and "NaN" not in data and "Infinity" not in data


def listed_model_ids(listing: Any) -> list[str]:
    """Model ids an upstream lists, kept only if they could be ours: short printable UTF-8 text.
    They become routes and metric labels, so an upstream cannot flood or poison either."""
    data = listing.get("data") if isinstance(listing, dict) else None
    ids: list[str] = []
    for m in data if isinstance(data, list) else []:
        name = m.get("id") if isinstance(m, dict) else None
        if isinstance(name, str) and 0 < len(name) <= MAX_MODEL_ID and name.isprintable():
            try:
                name.encode("utf-8")
            except UnicodeEncodeError:
                continue
            ids.append(name)
        if len(ids) >= MAX_MODELS:
            break
    return ids


def short_message(value: Any) -> str:
    return str(value)[:MAX_MESSAGE]


async def sse_data(response: UpstreamResponse, max_line: int) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream (multi-line data joined with newlines).

    Lines are split here, not by the HTTP client, so that no line (and no event) may exceed `max_line` bytes,
    and bytes that are not UTF-8 are a protocol error rather than a crash."""
    pending = b""
    lines: list[str] = []
    size = 0
    async for part in decoded(response):
        pending += part
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            try:
                line = raw.rstrip(b"\r").decode("utf-8")
            except UnicodeDecodeError:
                raise Malformed("sent an event stream that is not UTF-8") from None
            if not line:
                if lines:
                    yield "\n".join(lines)
                    lines, size = [], 0
            elif line.startswith("data:"):
                size += len(line)
                if size > max_line:
                    raise Malformed(f"sent an event over {max_line} bytes")
                lines.append(line[5:].lstrip(" "))
        if len(pending) > max_line:
            raise Malformed(f"sent an event line over {max_line} bytes")
    if pending.strip():
        try:
            line = pending.rstrip(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            raise Malformed("sent an event stream that is not UTF-8") from None
        if line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
    if lines:
        yield "\n".join(lines)


async def error_from(response: UpstreamResponse, name: str, limit: int) -> GatewayError:
    status = response.status_code
    try:
        raw = await read_capped(response, min(limit, 1 << 20))
    except (Malformed, TransportError):
        raw = b""
    finally:
        await response.aclose()
    message, code, param, etype = f"backend {name} answered {status}", None, None, None
    try:
        err = json.loads(raw).get("error")
        if isinstance(err, dict):
            message = short_message(err.get("message") or message)
            code, param, etype = err.get("code"), err.get("param"), err.get("type")
        elif isinstance(err, str):
            message = short_message(err)
    except (ValueError, UnicodeDecodeError, RecursionError, AttributeError):
        pass
    param = param if isinstance(param, str) and _PARAM.match(param) else None
    etype = etype if isinstance(etype, str) and _WORD.match(etype) else None
    retry_after = retry_after_seconds(response.headers.get("retry-after"))
    retryable = status == 429 or status >= 500
    shown = client_message(status, message, name)
    if shown != message:
        logger.warning("backend %s answered %d: %s", name, status, message)
    return GatewayError(
        status if 400 <= status <= 599 else 502,
        shown,
        code=code if isinstance(code, str) and _WORD.match(code) else None,
        param=param,
        retryable=retryable,
        retry_after=retry_after,
        type=etype,
    )


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds to wait, from delta-seconds or an HTTP date; None for anything not finite or sane."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return min(MAX_RETRY_AFTER, max(0.0, seconds))
