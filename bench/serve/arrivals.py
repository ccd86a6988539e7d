"""When requests arrive: closed loop, Poisson, gamma (bursty), or a replayed production trace.

Open-loop schedules are lists of offsets in seconds from the start; a closed loop has none (the
next request leaves when one finishes).
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "azure_llm_trace_2023"


@dataclass(slots=True)
class TraceRequest:
    offset: float  # seconds from the first request of the trace
    context_tokens: int
    generated_tokens: int


def poisson(rate: float, n: int, seed: int = 0) -> list[float]:
    return gamma(rate, n, burstiness=1.0, seed=seed)


def gamma(rate: float, n: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Inter-arrival times ~ Gamma(shape=burstiness, mean=1/rate). burstiness 1 is Poisson;
    below 1 arrivals clump (vLLM's --burstiness)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def load_trace(name: str, limit: int | None = None) -> list[TraceRequest]:
    """The Azure LLM inference trace ('code' or 'conv'), offsets from its first request."""
    path = TRACE_DIR / f"AzureLLMInferenceTrace_{name}.csv"
    rows: list[TraceRequest] = []
    with path.open() as f:
        reader = csv.DictReader(f)
        first = None
        for row in reader:
            ts = _seconds(row["TIMESTAMP"])
            first = ts if first is None else first
            rows.append(TraceRequest(ts - first, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def scale_trace(trace: list[TraceRequest], rate: float) -> list[float]:
    """The trace's offsets, stretched or squeezed so that its mean rate becomes `rate` (bursts kept)."""
    if len(trace) < 2:
        return [0.0 for _ in trace]
    span = trace[-1].offset - trace[0].offset
    native = (len(trace) - 1) / span if span > 0 else rate
    factor = native / rate
    return [r.offset * factor for r in trace]


def _seconds(stamp: str) -> float:
    # "2023-11-16 18:15:46.6805900": sub-microsecond digits are beyond datetime's reach.
    from datetime import datetime

    date, _, frac = stamp.partition(".")
    base = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)
