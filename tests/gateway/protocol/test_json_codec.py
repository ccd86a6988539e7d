"""The hot path's JSON: where orjson decides, it gives the standard library's answer; elsewhere it
leaves the document to the caller's standard-library path."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgate.gateway.protocol import json_codec
from specgate.gateway.protocol.json_codec import UNDECIDED

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past 64 bits on both sides
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)  # surrogates included: hypothesis draws them
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=25,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with types: 1 and 1.0 differ, NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=400, deadline=None)
@given(documents, st.booleans())
@pytest.mark.slow
def test_loads_agrees_with_the_standard_library_or_leaves_it_to_it(doc: Any, ascii_only: bool) -> None:
    text = json.dumps(doc, ensure_ascii=ascii_only)
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not UTF-8 at all, as no client could send it
        return
    for given_ in (raw, text):
        parsed = json_codec.loads(given_)
        if parsed is not UNDECIDED:
            assert _same(parsed, json.loads(text))


@settings(max_examples=400, deadline=None)
@given(documents)
@pytest.mark.slow
def test_dumps_encodes_what_the_standard_library_reads_back_the_same(doc: Any) -> None:
    encoded = json_codec.dumps(doc)
    if encoded is None:
        return
    assert _same(json.loads(encoded), _nulls(json.loads(json.dumps(doc))))


def _nulls(value: Any) -> Any:
    """What encoding makes of a value: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_nulls(v) for v in value]
    if isinstance(value, dict):
        return {k: _nulls(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize(
    "raw",
    [
        b'{"seed": 18446744073709551616}',  # beyond 64 bits: orjson would make it a float
        b'{"seed": -9223372036854775809}',
        b'{"t": NaN}',
        b'{"t": 1e400}',
        b'{"m": "\\ud800"}',  # a lone surrogate escape
        b'\xef\xbb\xbf{"a": 1}',  # a byte order mark
        b'{"a": "\xff"}',  # not UTF-8
        b"[" * 2000 + b"]" * 2000,
        b'{"a": 1',
    ],
)
def test_what_orjson_would_answer_differently_goes_to_the_standard_library(raw: bytes) -> None:
    assert json_codec.loads(raw) is UNDECIDED


def test_ordinary_documents_are_decided() -> None:
    assert json_codec.loads(b'{"seed": 999999999999999999, "x": [1.5, "\\ud83d\\ude00"]}') == {
        "seed": 10**18 - 1,
        "x": [1.5, "\U0001f600"],
    }


@pytest.mark.parametrize("value", [{"m": "\ud800"}, {1: "a"}, 2**64, {"n": -(2**63) - 1}])
def test_dumps_declines_what_orjson_cannot_encode(value: Any) -> None:
    assert json_codec.dumps(value) is None


def test_dumps_is_compact_utf8_and_nulls_non_finite_numbers() -> None:
    encoded = json_codec.dumps({"a": "é", "b": [1, 2.5], "c": float("nan")})
    assert encoded == '{"a":"é","b":[1,2.5],"c":null}'.encode()
