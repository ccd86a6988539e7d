"""Serving-metric arithmetic on synthetic streams with known timings."""

from __future__ import annotations

import math
import random

import pytest

from specgate.bench.serve.metrics import (
    RequestResult,
    bootstrap_interval,
    distribution,
    geomean,
    percentile,
    summarize,
)


def stream(
    rid: str, sent: float, chunks: list[float], tokens: int, done: float, **spec: object
) -> RequestResult:
    r = RequestResult(
        rid, "code", "ngram", sent_at=sent, ok=True, output_tokens=tokens, chunk_times=chunks, done_at=done
    )
    r.spec = dict(spec)
    return r


def test_per_request_timings() -> None:
    r = stream("a", 10.0, [10.2, 10.3, 10.5], tokens=5, done=10.6)
    assert r.ttft == pytest.approx(0.2) and r.e2e == pytest.approx(0.6)
    assert r.tpot == pytest.approx((0.6 - 0.2) / 4)  # chunks may carry several tokens: TPOT uses tokens
    assert r.itls == pytest.approx([0.1, 0.2])


def test_percentiles_interpolate_like_numpy() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert (
        percentile(xs, 50) == 2.5
        and percentile(xs, 90) == pytest.approx(3.7)
        and percentile(xs, 99) == pytest.approx(3.97)
    )
    assert percentile([], 50) is None
    d = distribution([0.001, 0.002, None], scale=1e3)
    assert d["mean"] == pytest.approx(1.5) and d["p50"] == pytest.approx(1.5)


def test_summary_throughput_goodput_and_acceptance() -> None:
    results = [
        stream(
            "a",
            0.0,
            [0.1, 0.2],
            tokens=11,
            done=1.1,
            num_drafts=4,
            num_draft_tokens=12,
            num_accepted_tokens=6,
            num_accepted_tokens_per_pos=[4, 2, 0],
        ),
        stream(
            "b",
            0.0,
            [0.5, 0.9],
            tokens=21,
            done=2.5,
            num_drafts=2,
            num_draft_tokens=6,
            num_accepted_tokens=0,
            num_accepted_tokens_per_pos=[0, 0, 0],
        ),
        RequestResult("c", "code", "ngram", sent_at=0.0, ok=False, error="APIError: boom"),
    ]
    s = summarize(results, duration=4.0, slos={"ttft": 200, "tpot": 100})
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["output_throughput"] == pytest.approx(32 / 4.0) and s["request_throughput"] == pytest.approx(0.5)
    assert s["goodput"] == pytest.approx(1 / 4.0)  # b misses the TTFT SLO (500 ms > 200 ms)
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p50"] == pytest.approx((100.0 + 100.0) / 2)  # a: 1.0 s / 10; b: 2.0 s / 20
    sp = s["spec"]
    assert sp["mean_acceptance_length"] == pytest.approx((6 + 6) / 6) and sp[
        "acceptance_rate"
    ] == pytest.approx(6 / 18)
    assert sp["acceptance_by_position"] == pytest.approx([4 / 6, 2 / 6, 0.0])
    assert summarize(results, 4.0)["goodput"] is None  # no SLOs given


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
