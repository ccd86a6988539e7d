"""Fitting a row's values to its table's columns before insert, so no value can make a batch fail.

Strings lose what no database stores (lone surrogates, NUL characters) and are cut to their
column's length; integers are clamped to the column's range; floats that are not finite become
NULL; JSON values get the same treatment at every level, bounded in depth and size. A row that
still fails is a bug, and the writer quarantines it rather than retrying it forever.
"""

from __future__ import annotations

import json
import math
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
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if INT64[0] <= value <= INT64[1] else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return clean_text(value, MAX_JSON_BYTES)
    if isinstance(value, dict):
        return {clean_text(str(k), 256): clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v, depth + 1) for v in value]
    return clean_text(str(value), 256)


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
    if value is None:
        return None
    if isinstance(column_type, Boolean):
        return bool(value)
    if isinstance(column_type, BigInteger):
        return _int(value, INT64)
    if isinstance(column_type, Integer):
        return _int(value, INT32)
    if isinstance(column_type, Float):
        return _float(value)
    if isinstance(column_type, String):  # Text too
        return clean_text(value if isinstance(value, str) else str(value), column_type.length)
    if isinstance(column_type, JSON):
        return _json_column(value)
    if isinstance(column_type, DateTime):
        return _float(value)  # unix seconds here; turned into datetimes by rows.to_sql
    return value


def fit_row(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    """`row` with every value fitted to its column; keys that are not columns are dropped."""
    return {c.name: fit_value(c.type, row.get(c.name)) for c in table.columns if c.name in row}
