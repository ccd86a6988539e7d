"""JSON on the hot path: orjson where it gives the standard library's answer, else the caller's
standard-library path, so every edge case keeps the one meaning it had.

orjson parses and encodes several times faster than `json` (the four JSON passes of a proxied
request were a tenth of a worker's CPU), but it differs on what a gateway must get right:
- integers beyond 64 bits come back as floats (a seed of 2**64 would lose its digits): a body with
  19 or more digits in a row goes the standard library's way, which keeps them exact;
- NaN, Infinity, lone surrogates, invalid UTF-8 and deep nesting are refused: the caller's own
  parser then decides, with the error message (or the leniency) it always had;
- a string with a lone surrogate, an integer beyond 64 bits or a non-string key cannot be encoded:
  `dumps` says so (None), and `encode` then takes the standard library's way. NaN / Infinity
  encode as null, which is what every caller here wants (a request never holds them; an
  upstream's become null).
"""

from __future__ import annotations

import json
from typing import Any, Final

import orjson

# Digits become "9", everything else a space: a run of 19 nines is then one fast substring search
# (a regex for [0-9]{19} cost five times orjson's whole parse). 2**63 has 19 digits: any shorter
# integer fits an int64.
_DIGITS = bytes(0x39 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"9" * 19
UNDECIDED: Final = object()  # `loads` left the document to the standard library


def loads(raw: bytes | str) -> Any:
    """The parsed document, or UNDECIDED where orjson's answer could differ from `json.loads`."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")  # a lone surrogate then fails orjson's UTF-8 check
    if _LONG_RUN in raw.translate(_DIGITS):
        return UNDECIDED
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return UNDECIDED


def dumps(value: Any) -> bytes | None:
    """Compact UTF-8 JSON, or None where orjson cannot encode `value` (see the module's notes)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return None


def encode(value: Any) -> bytes:
    """Compact JSON that can always be written: orjson's where it can; else the standard library's,
    ASCII-escaped if the text holds a lone surrogate UTF-8 cannot carry, with NaN / Infinity as null."""
    fast = dumps(value)
    if fast is not None:
        return fast
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:  # NaN / Infinity: null is the nearest valid JSON
        return json.dumps(finite(value), ensure_ascii=True, separators=(",", ":")).encode()


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
