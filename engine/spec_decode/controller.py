"""Draft-length controllers: how many tokens each speculating request drafts this step.

- `goodput` (dynamic K): for the whole batch, add draft tokens one at a time, best expected gain
  first, while each one raises expected goodput (emitted tokens per second of step time). The
  gain of a request's j-th draft token is the estimated probability that drafts 1..j are all
  accepted (per-position EWMA seeded from the request's prior); the cost is the measured growth
  of forward time with batch tokens plus the proposer's measured drafting time. In a large batch
  one step already emits many tokens, so small gains stop paying and k falls to 0.
- `static`: always `num_speculative_tokens`.
- `heuristic`: Hugging Face's schedule: +2 after a fully accepted draft, -1 otherwise.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.params import SpecParams

ACCEPTANCE_EWMA = 0.15
# Per step without drafts, estimates drift this far back toward the prior, so a request that
# stopped speculating (low acceptance) probes again later instead of staying off for good.
ACCEPTANCE_RELAX = 0.01


@dataclass(slots=True)
class SpecState:
    """A request's speculation state: its settings and what it has learnt about acceptance."""

    params: SpecParams
    alpha: list[float] = field(default_factory=list)  # P(draft j accepted | drafts < j accepted)
    k_current: int = 0  # the heuristic controller's running draft length

    def __post_init__(self) -> None:
        self.alpha = [self.params.acceptance_prior] * self.params.k_max
        self.k_current = min(max(self.params.num_speculative_tokens, self.params.k_min), self.params.k_max)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        for j in range(min(num_accepted + 1, num_drafted)):
            hit = 1.0 if j < num_accepted else 0.0
            self.alpha[j] += ACCEPTANCE_EWMA * (hit - self.alpha[j])
        if num_drafted:
            grown = self.k_current + 2 if num_accepted == num_drafted else self.k_current - 1
            self.k_current = min(max(grown, self.params.k_min, 1), self.params.k_max)

    def relax(self) -> None:
        prior = self.params.acceptance_prior
        self.alpha = [a + ACCEPTANCE_RELAX * (prior - a) for a in self.alpha]


@dataclass(slots=True)
class Candidate:
    state: SpecState
    method: str
    autoregressive: bool  # the proposer pays one drafting step per token, not one per call
    k_cap: int  # hard cap from max_tokens, context length and KV room


def _clamp(k: int, c: Candidate) -> int:
    return max(0, min(k, c.k_cap, c.state.params.k_max))


class _DraftCost:
    """Drafting seconds of a step as tokens are added: lookups cost once per proposer per step,
    autoregressive drafters once per token (an upper bound: requests draft in parallel)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.seconds = 0.0
        self.called: set[str] = set()

    def extra(self, c: Candidate) -> float:
        if c.autoregressive:
            return self.cost.draft_time(c.method)
        return 0.0 if c.method in self.called else self.cost.draft_time(c.method)

    def add(self, c: Candidate) -> None:
        self.seconds += self.extra(c)
        self.called.add(c.method)


def choose_k(
    candidates: Sequence[Candidate],
    num_emitting: int,
    num_tokens: int,
    budget: int,
    cost: CostModel,
    context: float = 0.0,
) -> list[int]:
    """Draft lengths for `candidates` in a step that already computes `num_tokens` tokens (each
    attending to `context` keys on average) and emits `num_emitting` tokens; at most `budget`
    draft tokens in all."""
    ks = [0] * len(candidates)
    dynamic: list[int] = []
    for i, c in enumerate(candidates):
        name = c.state.params.controller
        if name == "static":
            ks[i] = _clamp(c.state.params.num_speculative_tokens, c)
        elif name == "heuristic":
            ks[i] = _clamp(c.state.k_current, c)
        else:
            ks[i] = _clamp(c.state.params.k_min, c)
            dynamic.append(i)
    total = num_tokens + sum(ks)
    if total - num_tokens > budget:  # fixed-length controllers alone overflow: shrink the longest
        for i in sorted(range(len(ks)), key=lambda j: -ks[j]):
            while total - num_tokens > budget and ks[i] > 0:
                ks[i] -= 1
                total -= 1
    draft = _DraftCost(cost)
    for c, k in zip(candidates, ks, strict=True):
        for _ in range(k):
            draft.add(c)
    # Fixed-length drafts count too: their expected tokens set the goodput a new token must beat.
    expected = float(num_emitting) + sum(_gain(c.state, k) for c, k in zip(candidates, ks, strict=True))
    step = cost.forward_time(total, context) + draft.seconds
    heap = [(-_marginal(candidates[i].state, ks[i]), i) for i in dynamic if ks[i] < _clamp(64, candidates[i])]
    heapq.heapify(heap)
    while heap and total - num_tokens < budget:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        c = candidates[i]
        new_step = cost.forward_time(total + 1, context) + draft.seconds + draft.extra(c)
        if (expected + gain) * step <= expected * new_step:
            continue  # this token does not pay; a cheaper one (another proposer) still might
        ks[i] += 1
        total += 1
        expected += gain
        draft.add(c)
        step = new_step
        if ks[i] < _clamp(64, c):
            heapq.heappush(heap, (-_marginal(c.state, ks[i]), i))
    return ks


def _marginal(state: SpecState, k: int) -> float:
    """Expected extra tokens from drafting a (k+1)-th token: P(drafts 1..k+1 all accepted)."""
    p = 1.0
    for a in state.alpha[: k + 1]:
        p *= a
    return p


def _gain(state: SpecState, k: int) -> float:
    return sum(_marginal(state, j) for j in range(k))
