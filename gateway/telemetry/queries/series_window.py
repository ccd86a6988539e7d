"""The time grid of a series: a window ending now, cut into steps aligned to multiples of the step
(so that the points of two refreshes line up), and the SQL that puts a row in its step."""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Float, Integer, cast, func, literal

from specgate.gateway.telemetry.tables import requests

MAX_POINTS = 1440  # one day at one-minute steps; a finer grid is refused, not silently thinned


@dataclass(frozen=True, slots=True)
class Grid:
    start: float  # unix seconds, inclusive
    step: float
    points: int

    @classmethod
    def ending_now(cls, window: float, step: float, now: float | None = None) -> Grid:
        if not (math.isfinite(window) and math.isfinite(step)) or window <= 0 or step <= 0:
            raise ValueError("window and step must be positive")
        points = math.ceil(window / step - 1e-9)
        if points > MAX_POINTS:
            raise ValueError(f"window / step gives {points} points; at most {MAX_POINTS}")
        now = time.time() if now is None else now
        end = math.floor(now / step) * step + step  # the step holding `now` is the last one
        return cls(end - points * step, step, points)

    @property
    def end(self) -> float:
        return self.start + self.points * self.step

    def times(self) -> list[float]:
        return [self.start + i * self.step for i in range(self.points)]

    def since(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.start, tz=dt.UTC)

    def until(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.end, tz=dt.UTC)


def epoch_seconds(engine: Engine, column: Any) -> Any:
    """SQL: a timestamp column as unix seconds (float), on SQLite and PostgreSQL."""
    if engine.dialect.name == "sqlite":
        # SQLAlchemy stores UTC timestamps as text; julianday reads them as UTC.
        return (func.julianday(column) - 2440587.5) * 86400.0
    return cast(func.extract("epoch", column), Float)


def bucket_of(engine: Engine, grid: Grid) -> Any:
    """SQL: the index of the step a request's arrival falls in (rows are already inside the grid)."""
    offset = (epoch_seconds(engine, requests.c.arrival_time) - literal(grid.start)) / literal(grid.step)
    if engine.dialect.name == "sqlite":
        return cast(offset, Integer)  # truncation is floor here: offsets are never negative
    return cast(func.floor(offset), Integer)
