"""Serving metrics as vLLM's `bench serve` reports them, computed from per-request timings, and the
statistics every benchmark here shares (percentile, geometric mean, bootstrap interval).

TTFT: first content token minus send time. TPOT: (E2E - TTFT) / (output tokens - 1). ITL: gaps
between successive content chunks (a chunk may carry several tokens). Goodput: requests per
second that met every SLO given.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    request_id: str
    category: str
    arm: str
    sent_at: float  # perf_counter seconds
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    done_at: float | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # metrics.spec_decoding from the gateway
    route: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def over(a: Any, b: Any) -> float | None:
    """a / b, None where either is missing or zero."""
    return a / b if a and b else None


def number(v: float | None, digits: int = 1) -> str:
    """A table cell: thousands separated, "-" for nothing measured."""
    return "-" if v is None else f"{v:,.{digits}f}"


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def geomean(values: Sequence[float]) -> float | None:
    """exp(mean(log x)): the mean that ratios take (2x and 0.5x average to 1x)."""
    if not values:
        return None
    return math.exp(math.fsum(math.log(v) for v in values) / len(values))


def bootstrap_interval(
    groups: Sequence[Sequence[float]],
    stat: Callable[[list[list[float]]], float | None],
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
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


def distribution(values: Iterable[float | None], scale: float = 1e3) -> dict[str, float | None]:
    """mean / p50 / p90 / p99, in ms by default."""
    xs = [v * scale for v in values if v is not None]
    out: dict[str, float | None] = {"mean": sum(xs) / len(xs) if xs else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(xs, p)
    return out


def summarize(
    results: Sequence[RequestResult], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Aggregate one arm's results. `slos` in ms: {"ttft": 500, "tpot": 50, "e2e": 10000}."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets(r, slos or {})]
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "goodput": len(good) / duration if duration > 0 and slos else None,
        "ttft_ms": distribution(r.ttft for r in ok),
        "tpot_ms": distribution(r.tpot for r in ok),
        "itl_ms": distribution(x for r in ok for x in r.itls),
        "e2e_ms": distribution(r.e2e for r in ok),
        "spec": spec_summary(ok),
    }


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    for name, limit_ms in slos.items():
        value = getattr(r, name)
        if value is None and name == "tpot":
            continue  # a one-token answer has no TPOT to miss
        if value is None or value * 1e3 > limit_ms:
            return False
    return True


def spec_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Mean accepted length and acceptance rate over the requests that speculated, per position too."""
    steps = drafted = accepted = 0
    by_pos: list[int] = []
    for r in results:
        s = r.spec or {}
        steps += s.get("num_drafts") or 0
        drafted += s.get("num_draft_tokens") or 0
        accepted += s.get("num_accepted_tokens") or 0
        for i, c in enumerate(s.get("num_accepted_tokens_per_pos") or []):
            if i >= len(by_pos):
                by_pos.append(0)
            by_pos[i] += c
    return {
        "num_drafts": steps,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "mean_acceptance_length": (accepted + steps) / steps if steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        # Share of verification steps whose i-th draft token was accepted.
        "acceptance_by_position": [c / steps for c in by_pos] if steps else [],
    }
