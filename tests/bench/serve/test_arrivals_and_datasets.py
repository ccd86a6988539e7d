"""Arrival schedules and the shipped workload data."""

from __future__ import annotations

import itertools
import statistics

import pytest

from specgate.bench.serve import arrivals, datasets


def test_poisson_and_gamma_rates() -> None:
    offs = arrivals.poisson(rate=4.0, n=4000, seed=1)
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    assert offs[0] == 0.0 and statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    bursty = arrivals.gamma(rate=4.0, n=4000, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.mean(bgaps) == pytest.approx(0.25, rel=0.1) and statistics.stdev(
        bgaps
    ) > 1.5 * statistics.stdev(gaps)
    with pytest.raises(ValueError):
        arrivals.gamma(0, 3)


def test_azure_trace_scaled_to_a_rate() -> None:
    trace = arrivals.load_trace("conv", limit=500)
    assert len(trace) == 500 and trace[0].offset == 0.0 and all(t.context_tokens > 0 for t in trace)
    offs = arrivals.scale_trace(trace, rate=1.0)
    assert offs[-1] == pytest.approx(499.0, rel=1e-6)  # 499 gaps at 1 req/s on average
    assert offs == sorted(offs)


def test_shipped_categories_and_tools() -> None:
    reqs = datasets.shipped(per_category=2, max_tokens=64)
    cats = [r.category for r in reqs]
    assert cats[: len(datasets.CATEGORIES)] == datasets.CATEGORIES  # interleaved
    assert all(cats.count(c) == 2 for c in datasets.CATEGORIES)
    tool = next(r for r in reqs if r.category == "tool_call")
    assert tool.tools and tool.tools[0]["type"] == "function"
    assert '"dict"' not in str(tool.tools).replace("'", '"')  # BFCL's "dict" became "object"
    with pytest.raises(ValueError):
        datasets.shipped(1, 8, ["poetry"])


def test_trace_lengths_pick_matching_prompts() -> None:
    pool = datasets.shipped(per_category=5, max_tokens=64)
    picked = datasets.match_lengths(pool, [(50, 10), (5000, 900)], max_context=400, max_tokens=128)
    assert picked[0].max_tokens == 10 and picked[1].max_tokens == 128
    lengths = sorted(r.approx_tokens for r in pool)
    assert abs(picked[0].approx_tokens - 50) == min(abs(n - 50) for n in lengths)
    assert abs(picked[1].approx_tokens - 400) == min(abs(n - 400) for n in lengths)


def test_custom_jsonl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hi", "category": "x", "max_tokens": 5}\n'
        '\n{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    reqs = datasets.from_jsonl(path, max_tokens=9)
    assert [(r.category, r.max_tokens) for r in reqs] == [("x", 5), ("custom", 9)]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompt"):
        datasets.from_jsonl(path, 9)
