"""The statistics every benchmark reports: percentiles, means, ratios, intervals and table cells."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
PERCENTILES = (50, 90, 99)
RESAMPLES, BOOTSTRAP_SEED = 2000, 0
# Student's t at 97.5% by degrees of freedom: intervals over a handful of repetitions.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def percentile(values: Iterable[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = list(values)
    return math.fsum(xs) / len(xs) if xs else None


def geomean(values: Sequence[float]) -> float | None:
    """exp(mean(log x)): the mean that ratios take (2x and 0.5x average to 1x)."""
    if not values:
        return None
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def over(a: Any, b: Any) -> float | None:
    """a / b, None where either is missing or zero."""
    return a / b if a and b else None


def distribution(values: Iterable[float | None], scale: float = 1e3) -> dict[str, float | None]:
    """mean / p50 / p90 / p99, in ms by default."""
    xs = [v * scale for v in values if v is not None]
    return {"mean": mean(xs), **{f"p{p}": percentile(xs, p) for p in PERCENTILES}}


def bootstrap_interval(
    groups: Sequence[Sequence[T]],
    stat: Callable[[list[list[T]]], float | None],
    resamples: int = RESAMPLES,
    level: float = 0.95,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float] | None:
    """The percentile interval of `stat` over `resamples` resamplings of `groups`, each group drawn
    with replacement within itself (a stratified bootstrap: a class keeps its number of prompts).
    Seeded, so a report's intervals are reproducible from its rows."""
    if not groups or not all(groups):
        return None
    rng = random.Random(seed)
    stats = [stat([rng.choices(g, k=len(g)) for g in groups]) for _ in range(resamples)]
    drawn = [s for s in stats if s is not None]
    tail = (1 - level) / 2 * 100
    low, high = percentile(drawn, tail), percentile(drawn, 100 - tail)
    return None if low is None or high is None else (low, high)


def t_interval(values: Sequence[float], t: float | None = None) -> dict[str, float]:
    """Mean and its 95% interval by Student's t (normal past 10 values); infinite for one value."""
    m = statistics.fmean(values)
    t = t or T95.get(len(values) - 1, 1.96)
    half = t * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.inf
    return {"mean": m, "low": m - half, "high": m + half, "n": len(values)}


def number(v: float | None, digits: int = 1) -> str:
    """A table cell: thousands separated, "-" for nothing measured."""
    return "-" if v is None else f"{v:,.{digits}f}"


def times(v: float | None, low: float | None = None, high: float | None = None) -> str:
    """A ratio cell: `1.42x`, with its interval `1.42x [1.31, 1.55]` when given."""
    if v is None:
        return "-"
    return f"{v:.2f}x" if low is None or high is None else f"{v:.2f}x [{low:.2f}, {high:.2f}]"


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
