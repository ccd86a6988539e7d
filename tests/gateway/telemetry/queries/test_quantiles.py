"""Percentiles from the log-spaced histograms the database counts: within one bin's ratio of the
exact value, exact at the ends, and the SQL bin agrees with the Python edges."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sqlalchemy import Column, Float, MetaData, Table, create_engine, insert, select

from specgate.gateway.telemetry.queries.quantiles import EDGES, N_EDGES, RATIO, bin_of, quantiles


def py_bin(value: float) -> int:
    return next((i for i, edge in enumerate(EDGES) if value < edge), N_EDGES)


def test_sql_bins_match_the_edges() -> None:
    engine = create_engine("sqlite://")
    table = Table("t", MetaData(), Column("v", Float))
    table.metadata.create_all(engine)
    # Every edge, just below and just above it, and both open ends.
    values = [0.0, 0.1, 5e6, *(e * f for e in EDGES for f in (0.9999, 1.0, 1.0001))]
    with engine.begin() as conn:
        conn.execute(insert(table), [{"v": v} for v in values])
        got = [row[0] for row in conn.execute(select(bin_of(table.c.v)).order_by(table.c.v))]
    assert got == [py_bin(v) for v in sorted(values)]


@pytest.mark.parametrize("seed", range(5))
def test_estimates_are_within_one_bin_of_numpy(seed: int) -> None:
    rng = random.Random(seed)
    values = [rng.lognormvariate(4.0, 1.2) for _ in range(rng.randint(20, 3000))]
    counts: dict[int, int] = {}
    for v in values:
        counts[py_bin(v)] = counts.get(py_bin(v), 0) + 1
    est = quantiles(counts.items(), (0.5, 0.9, 0.99), min(values), max(values))
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(values, q))
        assert exact / RATIO <= est[f"p{round(q * 100)}"] <= exact * RATIO, (q, exact, est)


def test_ends_and_empty() -> None:
    assert quantiles([(py_bin(42.0), 1)], (0.5, 0.99), 42.0, 42.0) == {"p50": 42.0, "p99": 42.0}
    assert quantiles([], (0.5,), None, None) == {"p50": None}
    assert quantiles([(3, 0)], (0.5,), None, None) == {"p50": None}
    # Beyond the last edge: the open bin, clamped to the maximum seen.
    assert quantiles([(N_EDGES, 2)], (0.99,), 2e6, 3e6) == {"p99": 2e6}
