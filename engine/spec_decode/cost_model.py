"""Online estimates of what a step costs: the forward pass by its tokens, and drafting time per step.

The forward pass is priced by the one step-cost curve the routing policy uses too
(`engine/step_cost.py`), fitted here on this engine's recent passes. A pass costs more with more
tokens and, for attention, with longer contexts: on CPU, verifying 5 tokens at a 1000-token context
costs ~27% more than decoding one, at a 100-token context ~5%. So passes are kept per context bucket
(the mean number of keys each new token attends to), each bucket its own curve over its last
`WINDOW` passes per size: the median shrugs off warm-up and stalls, the window follows the machine
as its load changes.
"""

from __future__ import annotations

from collections import deque

from specgate.engine.step_cost import StepCost, bucket

# Until measured otherwise, each extra token in a forward pass is assumed to add this fraction of
# a one-token step (decode is weight-bandwidth bound, so a few more rows cost little). It prices
# sizes past the only one measured; once two are, the curve's own last segment does.
PRIOR_MARGINAL_FRACTION = 0.03
WINDOW = 15  # recent passes kept per (context bucket, token bucket)
_DRAFT_EWMA = 0.2


def _prior(num_tokens: int) -> float:
    """A pass's cost in one-token steps, before two sizes are measured anywhere."""
    return 1.0 + PRIOR_MARGINAL_FRACTION * (num_tokens - 1)


def _context_bucket(context: float) -> int:
    """0 below 128 keys per token, then one bucket per doubling."""
    return (int(context) >> 7).bit_length()


class _Passes:
    """Recent passes of one context bucket, and the curve fitted on them (refitted when asked after
    a new pass: the controller asks many times per step, a pass arrives once)."""

    def __init__(self) -> None:
        self.by_bucket: dict[int, deque[tuple[int, float]]] = {}
        self.curve: StepCost | None = None
        self.seen = 0

    def observe(self, num_tokens: int, ms: float) -> None:
        key = bucket(num_tokens)
        window = self.by_bucket.get(key)
        if window is None:
            window = self.by_bucket[key] = deque(maxlen=WINDOW)
        window.append((num_tokens, ms))
        self.seen += 1
        self.curve = None

    def fitted(self) -> StepCost:
        if self.curve is None:
            # Sizes passed fewer than MIN_BUCKET_STEPS times are priced from the others (one stalled
            # pass must not make a size look unaffordable, and so never measured again), unless no
            # size has been passed that often yet.
            self.curve = StepCost.from_buckets(self.by_bucket, self.seen) or StepCost.from_buckets(
                self.by_bucket, self.seen, min_bucket=1
            )
            assert self.curve is not None  # observe() put at least one pass in
        return self.curve


class CostModel:
    def __init__(self) -> None:
        self._passes: dict[int, _Passes] = {}
        self._draft: dict[str, float] = {}  # EWMA seconds per drafting step, by proposer

    def observe_forward(self, num_tokens: int, seconds: float, context: float = 0.0) -> None:
        """A forward pass over `num_tokens` new tokens (with its sampling and verification), each
        attending to `context` keys on average."""
        if num_tokens < 1 or not 0.0 < seconds < 1e3:
            return
        key = _context_bucket(context)
        passes = self._passes.get(key)
        if passes is None:
            passes = self._passes[key] = _Passes()
        passes.observe(num_tokens, seconds * 1e3)

    def _nearest(self, context: float) -> list[_Passes]:
        """The measured context buckets, nearest `context` first (ties: the longer context)."""
        key = _context_bucket(context)
        return [self._passes[b] for b in sorted(self._passes, key=lambda b: (abs(b - key), -b))]

    def curve(self, context: float = 0.0) -> StepCost | None:
        """The step-cost curve (ms by tokens) of the measured context bucket nearest `context`."""
        nearest = self._nearest(context)
        return nearest[0].fitted() if nearest else None

    def forward_time(self, num_tokens: int, context: float = 0.0) -> float:
        """Seconds for a forward pass; relative units before any data."""
        curve = self.curve(context)
        if curve is None:
            return _prior(num_tokens)
        if len(curve.tokens) == 1 and num_tokens != curve.tokens[0]:
            # One size measured at this context (decoding alone, or one prefill chunk): other sizes
            # scale from it as they do at the nearest context that has measured several (the
            # products dominate a pass and do not depend on the context), else by the prior. Not
            # flat: a bucket that has seen only a 500-token prefill chunk would price a 16-token
            # decode step, and any drafts added to it, at that chunk's cost.
            x, ms = curve.tokens[0], curve.ms[0]
            shape = self._shape(context)
            grow = shape.at(num_tokens) / shape.at(x) if shape else _prior(num_tokens) / _prior(x)
            return ms * grow / 1e3
        return curve.at(num_tokens) / 1e3

    def _shape(self, context: float) -> StepCost | None:
        """The curve of the context bucket nearest `context` that has measured two sizes or more."""
        return next((c for c in (p.fitted() for p in self._nearest(context)) if len(c.tokens) > 1), None)

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
