"""The statistics every benchmark shares: percentiles, means, intervals and table cells."""

from __future__ import annotations

import math
import random

import pytest

from specgate.bench.stats import (
    bootstrap_interval,
    distribution,
    geomean,
    number,
    over,
    percentile,
    t_interval,
    table,
    times,
)


def test_percentiles_interpolate_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97) and percentile([], 50) is None
    values = [float(v) for v in range(1, 101)]
    assert (
        percentile(values, 50) == 50.5 and percentile(values, 100) == 100.0 and percentile(values, 0) == 1.0
    )
    d = distribution([0.001, 0.002, None], scale=1e3)
    assert d["mean"] == pytest.approx(1.5) and d["p50"] == pytest.approx(1.5)


def test_geomean_averages_ratios_symmetrically() -> None:
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([3.0]) == pytest.approx(3.0) and geomean([]) is None


def first_geomean(groups: list[list[float]]) -> float | None:
    return geomean(groups[0])


def test_a_constant_sample_has_a_point_interval_and_the_seed_fixes_the_rest() -> None:
    assert bootstrap_interval([[2.0, 2.0, 2.0]], first_geomean) == pytest.approx((2.0, 2.0))
    xs = [1.0, 1.5, 2.0, 3.0, 0.8]
    assert bootstrap_interval([xs], first_geomean, seed=1) == bootstrap_interval([xs], first_geomean, seed=1)
    assert bootstrap_interval([xs], first_geomean, seed=1) != bootstrap_interval([xs], first_geomean, seed=2)
    assert bootstrap_interval([], first_geomean) is None and bootstrap_interval([[]], first_geomean) is None


def test_resampling_stays_within_each_group() -> None:
    """Stratified: a resample of [[1, 1], [100]] always holds two 1s and one 100."""
    seen: list[list[list[float]]] = []

    def record(groups: list[list[float]]) -> float:
        seen.append(groups)
        return 0.0

    bootstrap_interval([[1.0, 1.0], [100.0]], record, resamples=50)
    assert len(seen) == 50 and all(g == [[1.0, 1.0], [100.0]] for g in seen)


def test_the_95_interval_of_a_geometric_mean_covers_the_true_ratio() -> None:
    """Per-prompt ratios of true geometric mean 1.3 with 10% noise: the interval contains 1.3 in
    about 95% of samples (and in this seeded one), and narrows as the sample grows."""
    rng = random.Random(7)

    def sample(n: int) -> list[float]:
        return [1.3 * math.exp(rng.gauss(0.0, 0.1)) for _ in range(n)]

    covered = 0
    for _ in range(40):
        low, high = bootstrap_interval([sample(30)], first_geomean, resamples=1000) or (0.0, 0.0)
        covered += low <= 1.3 <= high
    assert covered >= 34  # 95% of 40 is 38; the percentile bootstrap runs a little under
    small = bootstrap_interval([sample(10)], first_geomean) or (0.0, 0.0)
    large = bootstrap_interval([sample(160)], first_geomean) or (0.0, 0.0)
    assert small[0] <= 1.3 <= small[1] and large[0] <= 1.3 <= large[1]
    assert large[1] - large[0] < (small[1] - small[0]) / 2


def test_a_t_interval_widens_with_few_values() -> None:
    two = t_interval([1.0, 3.0])
    assert two["mean"] == 2.0 and two["n"] == 2
    assert two["high"] - two["mean"] == pytest.approx(12.71 * math.sqrt(2) / math.sqrt(2))
    many = t_interval([1.0, 3.0] * 10, 1.96)
    assert many["high"] - many["mean"] < 0.5 and t_interval([5.0])["high"] == math.inf


def test_cells() -> None:
    assert number(1234.567) == "1,234.6" and number(None) == "-" and number(2.0, 0) == "2"
    assert times(1.4249) == "1.42x" and times(1.42, 1.31, 1.55) == "1.42x [1.31, 1.55]" and times(None) == "-"
    assert over(3, 2) == 1.5 and over(3, 0) is None and over(None, 2) is None
    assert table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
