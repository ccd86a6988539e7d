"""What a step costs: one curve of a forward pass's wall time by the number of tokens in it, for
the engine's draft-length controller and the gateway's routing policy alike.

Both price the same quantity, measured at the same point: the milliseconds from the start of a
forward pass to the end of its sampling and verification, for a pass over n tokens (every
sequence's new tokens, drafts included). The engine fits the curve live from its recent passes
(`engine/spec_decode/cost_model.py`, one curve per context length); the routing policy fits it from
the `spec_steps` telemetry rows those same passes wrote (`policies/training/retrain.py`). This
module imports nothing of the project, so that `policies` may import it (the one exception to its
import contract) and neither side keeps a copy of the other's arithmetic.

The curve: a median per bucket of tokens (each size up to 16 its own, then four buckets per doubling:
kernels pass over a few rows at a time, so a pass's cost is not smooth at small sizes), made
non-decreasing, interpolated between buckets; beyond the last, linear in tokens along the last
segment (compute-bound by then); below the first, along the first segment but never under a cost
proportional to tokens. Verification passes hold at least two tokens, so plain decoding's one-token
pass is rarely measured where a request speculates, and pricing it at the smallest measured pass
would overstate speculation's gain by that pass's premium.

At batch B, a plain decode step computes B tokens and emits B; a speculative step computes B * (k + 1)
(each sequence's last token and k drafts) and emits B * (1 + a), a = expected accepted drafts. With
T(n) the curve, speculation's goodput relative to plain decoding is

    (1 + a) * T(B) / T(B * (k + 1))

which is above 1 while passes are memory-bound (T nearly flat in n) and falls below it once they
are compute-bound: the crossover follows each machine and model instead of one constant (vLLM
measured acceptance steady from batch 1 to 32 while the speedup went from +23% to -16%: acceptance
alone cannot tell). Expected accepted drafts of a chain of k with per-position acceptance p:
p (1 - p^k) / (1 - p).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_STEPS = 50  # measured steps before a curve is trusted
MIN_BUCKET_STEPS = 3
MAX_BATCH = 4096  # crossover search bound, in sequences
EXACT_TOKENS = 16


def bucket(tokens: int) -> int:
    """Each size up to EXACT_TOKENS its own bucket; beyond, a quarter of a doubling each."""
    if tokens <= EXACT_TOKENS:
        return tokens
    octave = tokens.bit_length() - 1
    return EXACT_TOKENS + 4 * octave + ((tokens >> (octave - 2)) & 3)


def expected_accepted(p: float, k: int) -> float:
    """Expected accepted drafts of a chain of k, each accepted with probability p given the last."""
    if k <= 0:
        return 0.0
    if p >= 1.0:
        return float(k)
    return p * (1.0 - p**k) / (1.0 - p)


@dataclass(slots=True)
class StepCost:
    tokens: list[int]  # bucket representatives (median tokens of the bucket's steps), increasing
    ms: list[float]  # step ms at those tokens, non-decreasing
    n_steps: int

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.ms):
            raise ValueError("a step cost curve needs matching, non-empty tokens and ms")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError("step cost tokens must increase")
        if any(m <= 0 for m in self.ms):
            raise ValueError("step times must be positive")

    @classmethod
    def fit(cls, steps: Iterable[tuple[int, float]], min_steps: int = MIN_STEPS) -> StepCost | None:
        """From (batch tokens, step ms) pairs; None with too few valid steps to say anything."""
        buckets: dict[int, list[tuple[int, float]]] = {}
        n = 0
        for tokens, ms in steps:
            if tokens is None or ms is None or tokens < 1 or not 0 < ms < 1e6:
                continue
            buckets.setdefault(bucket(int(tokens)), []).append((int(tokens), float(ms)))
            n += 1
        if n < min_steps:
            return None
        return cls.from_buckets(buckets, n)

    @classmethod
    def from_buckets(
        cls,
        buckets: Mapping[int, Sequence[tuple[int, float]]],
        n_steps: int,
        min_bucket: int = MIN_BUCKET_STEPS,
    ) -> StepCost | None:
        """From (tokens, ms) pairs already grouped by `bucket`; buckets with fewer than `min_bucket`
        pairs say nothing yet (one stalled pass must not price a size). None: no bucket qualifies."""
        xs: list[int] = []
        ys: list[float] = []
        for _, pairs in sorted(buckets.items()):
            if len(pairs) < max(1, min_bucket):
                continue
            x = round(statistics.median(t for t, _ in pairs))
            if xs and x <= xs[-1]:
                continue
            xs.append(x)
            ys.append(statistics.median(m for _, m in pairs))
        if not xs:
            return None
        for i in range(1, len(ys)):  # more tokens never cost less: noise is not a discount
            ys[i] = max(ys[i], ys[i - 1])
        return cls(xs, ys, n_steps)

    def at(self, tokens: float) -> float:
        """Step ms over `tokens` tokens."""
        xs, ys = self.tokens, self.ms
        if tokens <= xs[0]:
            if len(xs) < 2 or tokens == xs[0]:
                return ys[0]
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return max(ys[0] - slope * (xs[0] - tokens), ys[0] * tokens / xs[0])
        i = bisect.bisect_left(xs, tokens)
        if i < len(xs):
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
        # Beyond the measurements: the last segment's cost per token (compute-bound by then).
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (tokens - xs[-1])

    def gain(self, batch: int, k: int, p: float) -> float:
        """Speculation's goodput over plain decoding at `batch` sequences, k drafts, acceptance p."""
        b = max(1, batch)
        return (1.0 + expected_accepted(p, k)) * self.at(b) / self.at(b * (k + 1))

    def best_k(self, batch: int, p: float, k_max: int) -> int:
        """The draft length (1..k_max) with the best gain at this batch; 0 if none beats plain decoding."""
        best, best_gain = 0, 1.0
        for k in range(1, k_max + 1):
            g = self.gain(batch, k, p)
            if g > best_gain:
                best, best_gain = k, g
        return best

    def crossover(self, p: float, k_max: int) -> int | None:
        """The smallest batch at which no k up to k_max pays (None: it pays up to MAX_BATCH)."""
        b = 1
        while b <= MAX_BATCH:
            if self.best_k(b, p, k_max) == 0:
                lo = b // 2 + 1
                return next((x for x in range(lo, b + 1) if self.best_k(x, p, k_max) == 0), b)
            b *= 2
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "ms": [round(m, 4) for m in self.ms], "n_steps": self.n_steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepCost:
        return cls([int(t) for t in d["tokens"]], [float(m) for m in d["ms"]], int(d.get("n_steps", 0)))
