"""Fitting a row's values to its table's columns before insert, so no value can make a batch fail.

Strings lose what no database stores (lone surrogates, NUL characters) and are cut to their
column's length; integers are clamped to the column's range; floats that are not finite become
NULL; JSON values get the same treatment at every level, bounded in depth and size. A row that
still fails is a bug, and the writer quarantines it rather than retrying it forever.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Integer, String, Table

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
MAX_JSON_DEPTH = 16
MAX_JSON_BYTES = 64 * 1024


def clean_text(value: str, limit: int | None = None) -> str:
    if not value.isascii():
        value = value.encode("utf-8", "replace").decode("utf-8")  # lone surrogates become "?"
    if "\x00" in value:
        value = value.replace("\x00", "")  # PostgreSQL text cannot hold NUL
    return value[:limit] if limit is not None else value


def clean_json(value: Any, depth: int = 0) -> Any:
    if depth > MAX_JSON_DEPTH:
        return None
    kind = type(value)
    # The common cases first, by exact type: this runs for every value of every JSON column.
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is str:
        return (
            value
            if value.isascii() and "\x00" not in value and len(value) <= MAX_JSON_BYTES
            else (clean_text(value, MAX_JSON_BYTES))
        )
    if value is None or kind is bool:
        return value
    if kind is int:
        return value if INT64[0] <= value <= INT64[1] else None
    if isinstance(value, dict):
        return {_json_key(k): clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v, depth + 1) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # numpy integers and other int subclasses
        return clean_json(int(value), depth)
    if isinstance(value, float):
        return clean_json(float(value), depth)
    if isinstance(value, str):
        return clean_text(str(value), MAX_JSON_BYTES)
    return clean_text(str(value), 256)


def _json_key(key: Any) -> str:
    if type(key) is str and len(key) <= 256 and key.isascii() and "\x00" not in key:
        return key
    return clean_text(str(key), 256)


def _json_column(value: Any) -> Any:
    cleaned = clean_json(value)
    try:
        size = len(json.dumps(cleaned, separators=(",", ":")))
    except (TypeError, ValueError):
        return None
    return cleaned if size <= MAX_JSON_BYTES else {"truncated": True, "bytes": size}


def _int(value: Any, bounds: tuple[int, int]) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = int(value)
    if not isinstance(value, int):
        return None
    return min(bounds[1], max(bounds[0], value))


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def fit_value(column_type: Any, value: Any) -> Any:
    return None if value is None else _fitter(column_type)(value)


def _fitter(column_type: Any) -> Callable[[Any], Any]:
    """The function that fits a (non-None) value to a column of this type."""
    if isinstance(column_type, Boolean):
        return bool
    if isinstance(column_type, BigInteger):
        return functools.partial(_int, bounds=INT64)
    if isinstance(column_type, Integer):
        return functools.partial(_int, bounds=INT32)
    if isinstance(column_type, Float):
        return _float
    if isinstance(column_type, String):  # Text too
        length = column_type.length
        return lambda v: clean_text(v if isinstance(v, str) else str(v), length)
    if isinstance(column_type, JSON):
        return _json_column
    if isinstance(column_type, DateTime):
        return _float  # unix seconds here; turned into datetimes by rows.to_sql
    return lambda v: v


@functools.cache
def _fitters(table: Table) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    # Decided once per table, not per value: the writer fits ~50 columns of every row it inserts.
    return tuple((c.name, _fitter(c.type)) for c in table.columns)


def fit_row(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    """`row` with every value fitted to its column; keys that are not columns are dropped."""
    out: dict[str, Any] = {}
    for name, fit in _fitters(table):
        if name in row:
            value = row[name]
            out[name] = None if value is None else fit(value)
    return out
