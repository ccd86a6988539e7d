"""Online estimates of what a step costs: target forward time by batch size, draft time per token."""

from __future__ import annotations

import bisect
import statistics
from collections import deque

# Until measured otherwise, each extra token in a forward pass is assumed to add this fraction of
# a one-token step (decode is weight-bandwidth bound, so a few more rows cost little).
PRIOR_MARGINAL_FRACTION = 0.03
# Recent samples kept per batch-size bucket; the median shrugs off warm-up and stalls.
_WINDOW = 15
_TRUSTED = 3  # samples before a bucket's median is used to interpolate its neighbours
_DRAFT_EWMA = 0.2


class CostModel:
    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}  # forward seconds by token bucket
        self._median: dict[int, float] = {}
        self._keys: list[int] = []
        self._draft: dict[str, float] = {}  # EWMA seconds per drafting step, by proposer

    @staticmethod
    def _bucket(num_tokens: int) -> int:
        if num_tokens <= 64:
            return num_tokens
        return 1 << (num_tokens - 1).bit_length()  # powers of two above 64

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        key = self._bucket(num_tokens)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = deque(maxlen=_WINDOW)
            bisect.insort(self._keys, key)
        samples.append(seconds)
        self._median[key] = statistics.median(samples)

    def forward_time(self, num_tokens: int) -> float:
        """Seconds for a forward pass over `num_tokens` tokens; relative units before any data.

        An unmeasured size is interpolated between measured neighbours, or extrapolated from the
        nearest smaller one with the prior marginal cost when the larger neighbour has too few
        samples to trust (a lone warm-up pass would otherwise make k+1 look unaffordable forever).
        """
        if not self._keys:
            return 1.0 + PRIOR_MARGINAL_FRACTION * (num_tokens - 1)
        key = self._bucket(num_tokens)
        i = bisect.bisect_left(self._keys, key)
        if key in self._median:
            if len(self._samples[key]) >= _TRUSTED or i == 0:
                return self._median[key]
            # One or two samples may be a one-off stall: trust them only up to twice what the
            # smaller neighbour predicts.
            lo = self._keys[i - 1]
            return min(
                self._median[key], 2 * self._median[lo] * (1 + PRIOR_MARGINAL_FRACTION * (num_tokens - lo))
            )
        if i == 0:
            near = self._keys[0]
            return self._median[near] * max(0.5, 1.0 - PRIOR_MARGINAL_FRACTION * (near - num_tokens))
        lo = self._keys[i - 1]
        extrapolated = self._median[lo] * (1.0 + PRIOR_MARGINAL_FRACTION * (num_tokens - lo))
        if i == len(self._keys) or len(self._samples[self._keys[i]]) < _TRUSTED:
            return extrapolated
        hi = self._keys[i]
        t_lo, t_hi = self._median[lo], self._median[hi]
        return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)

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
