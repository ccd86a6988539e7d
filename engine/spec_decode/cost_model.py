"""Online estimates of what a step costs: target forward time by batch shape, draft time per step.

A forward pass costs more with more tokens and, for attention, with longer contexts: on CPU,
verifying 5 tokens at a 1000-token context costs ~27% more than decoding one, at a 100-token
context ~5%. So samples are kept per (context bucket, token bucket), where the context is the
mean number of keys each new token attends to.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

# Until measured otherwise, each extra token in a forward pass is assumed to add this fraction of
# a one-token step (decode is weight-bandwidth bound, so a few more rows cost little).
PRIOR_MARGINAL_FRACTION = 0.03
# Recent samples kept per bucket; the median shrugs off warm-up and stalls.
_WINDOW = 15
_TRUSTED = 3  # samples before a bucket's median is trusted beyond a sanity ceiling
_DRAFT_EWMA = 0.2


def _token_bucket(num_tokens: int) -> int:
    return num_tokens if num_tokens <= 64 else 1 << (num_tokens - 1).bit_length()


def _context_bucket(context: float) -> int:
    """0 below 128 keys per token, then one bucket per doubling."""
    return (int(context) >> 7).bit_length()


class _Table:
    """Forward seconds by token bucket, for one context bucket."""

    def __init__(self) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.median: dict[int, float] = {}
        self.keys: list[int] = []

    def observe(self, num_tokens: int, seconds: float) -> None:
        key = _token_bucket(num_tokens)
        samples = self.samples.get(key)
        if samples is None:
            samples = self.samples[key] = deque(maxlen=_WINDOW)
            bisect.insort(self.keys, key)
        samples.append(seconds)
        self.median[key] = statistics.median(samples)

    def estimate(self, num_tokens: int) -> float:
        """Measured where possible; between measured sizes interpolated; beyond them, or next to a
        barely measured size (a lone warm-up pass would make k+1 look unaffordable forever),
        extrapolated from the nearest smaller size with the prior marginal cost."""
        key = _token_bucket(num_tokens)
        i = bisect.bisect_left(self.keys, key)
        if i == 0:
            near = self.keys[0]
            if key == near:
                return self.median[key]
            return self.median[near] * max(0.5, 1.0 - PRIOR_MARGINAL_FRACTION * (near - num_tokens))
        lo = self.keys[i - 1]
        extrapolated = self.median[lo] * (1.0 + PRIOR_MARGINAL_FRACTION * (num_tokens - lo))
        if key in self.median:
            if len(self.samples[key]) >= _TRUSTED:
                return self.median[key]
            return min(self.median[key], 2 * extrapolated)  # one or two samples may be a stall
        if i == len(self.keys) or len(self.samples[self.keys[i]]) < _TRUSTED:
            return extrapolated
        hi = self.keys[i]
        t_lo, t_hi = self.median[lo], self.median[hi]
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)


class CostModel:
    def __init__(self) -> None:
        self._tables: dict[int, _Table] = {}
        self._draft: dict[str, float] = {}  # EWMA seconds per drafting step, by proposer

    def observe_forward(self, num_tokens: int, seconds: float, context: float = 0.0) -> None:
        """A forward pass over `num_tokens` new tokens, each attending to `context` keys on average."""
        bucket = _context_bucket(context)
        table = self._tables.get(bucket)
        if table is None:
            table = self._tables[bucket] = _Table()
        table.observe(num_tokens, seconds)

    def forward_time(self, num_tokens: int, context: float = 0.0) -> float:
        """Seconds for a forward pass; relative units before any data."""
        if not self._tables:
            return 1.0 + PRIOR_MARGINAL_FRACTION * (num_tokens - 1)
        bucket = _context_bucket(context)
        nearest = min(self._tables, key=lambda b: (abs(b - bucket), -b))
        return self._tables[nearest].estimate(num_tokens)

    def observe_draft(self, method: str, steps: int, seconds: float) -> None:
        """A propose call of `method` took `seconds` for `steps` sequential drafting steps (the
        longest draft for an autoregressive proposer, 1 for a lookup)."""
        if steps <= 0:
            return
        per_step = seconds / steps
        old = self._draft.get(method)
        self._draft[method] = per_step if old is None else old + _DRAFT_EWMA * (per_step - old)

    def draft_time(self, method: str) -> float:
        """Seconds per drafting step of `method` (0 before it was measured)."""
        return self._draft.get(method, 0.0)
