"""Latency percentiles the same way on SQLite and PostgreSQL: a log-spaced histogram per group,
counted by the database, and quantiles interpolated from it here (as Prometheus'
histogram_quantile does from its buckets).

SQLite has no percentile function, and fetching every value of a busy window would not scale; a
histogram is a few hundred rows whatever the traffic. Bins grow by RATIO, so an estimate is within
that factor of the true value; it is also clamped to the group's exact minimum and maximum, so a
group of one value, or a quantile at either end, is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import case

LOW_MS = 0.25  # the first bin holds everything below this
RATIO = 1.15
N_EDGES = 110  # up to LOW_MS * RATIO**109, about 1.1e6 ms (18 minutes); the last bin is open
EDGES: tuple[float, ...] = tuple(LOW_MS * RATIO**i for i in range(N_EDGES))


GROUP = 10  # edges per branch of the outer CASE: ~20 comparisons a row instead of up to 110


def bin_of(column: Any) -> Any:
    """SQL: the histogram bin of a value in milliseconds (0 .. N_EDGES), by a two-level CASE."""
    branches = []
    for start in range(0, N_EDGES, GROUP):
        group = range(start, min(start + GROUP, N_EDGES))
        inner = case(*((column < EDGES[i], i) for i in group[:-1]), else_=group[-1])
        branches.append((column < EDGES[group[-1]], inner))
    return case(*branches, else_=N_EDGES)


def _bounds(index: int) -> tuple[float, float]:
    lo = 0.0 if index == 0 else EDGES[index - 1]
    hi = EDGES[index] if index < N_EDGES else EDGES[-1] * RATIO
    return lo, hi


def quantiles(
    counts: Iterable[tuple[int, int]], qs: Sequence[float], lo: float | None, hi: float | None
) -> dict[str, float | None]:
    """Quantiles `qs` (0-1) from (bin, count) pairs, clamped to the group's [lo, hi]; keys p50...."""
    ordered = sorted((int(b), int(c)) for b, c in counts if c)
    total = sum(c for _, c in ordered)
    out: dict[str, float | None] = {}
    for q in qs:
        key = f"p{round(q * 100):d}"
        if not total:
            out[key] = None
            continue
        rank = q * total
        seen = 0
        value = hi if hi is not None else _bounds(ordered[-1][0])[1]
        for index, count in ordered:
            if seen + count >= rank:
                a, b = _bounds(min(index, N_EDGES))
                frac = (rank - seen) / count
                # Geometric inside a bin (they are log-spaced), linear in the first (from 0).
                value = a + (b - a) * frac if a <= 0 else a * (b / a) ** frac
                break
            seen += count
        if lo is not None:
            value = max(value, lo)
        if hi is not None:
            value = min(value, hi)
        out[key] = None if value is None or not math.isfinite(value) else round(value, 3)
    return out
