"""Draft-length controllers: how many tokens each speculating request drafts this step.

- `goodput` (dynamic K): for the whole batch, add draft tokens one at a time, best expected gain
  first, while each one raises expected goodput (emitted tokens per second of step time). The
  gain of a request's j-th draft token is the estimated probability that drafts 1..j are all
  accepted (per-position EWMA seeded from the request's prior); the cost is the measured growth
  of forward time with batch tokens plus the proposer's measured drafting time. In a large batch
  one step already emits many tokens, so small gains stop paying and k falls to 0.
  Expectations can be wrong, so each request also keeps a ledger of what speculation has actually
  done for it, in steps: + each accepted draft (a step it did not wait for), - the measured extra
  time of its drafts in each pass they joined, + PROBE_CREDIT per step it decoded without drafts.
  Once the ledger is below -LEDGER_FLOOR the request does not draft (its k_min included) until
  the credit lets it probe again: a request whose drafts fail stops within a few steps, and
  probes after that cost it at most PROBE_CREDIT of its time; one whose probe pays drafts again.
- `static`: always `num_speculative_tokens`.
- `heuristic`: Hugging Face's schedule: +2 after a fully accepted draft, -1 otherwise.

Draft trees: k is a tree's depth, and its first path (the chain) is what k buys. `grow_trees` then
adds branch nodes across the batch the same way, best expected gain first, while each one raises
goodput. A node's gain is the product of its path's edge probabilities: the proposer's score for
the node (its draft probability, a continuation's share) scaled by how well the request has found
those scores to predict acceptance; for a proposer without scores, what the request has learnt per
sibling rank (the chance that the target's token is the rank-r child where the children before it
were not). Under load every extra token costs more than it gains, so trees shrink to chains, then
to nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.draft_tree import children, depths, first_path, ranks
from specgate.engine.vocab import K_MAX, SpecParams

ACCEPTANCE_EWMA = 0.15
# A request may lose this many steps to speculation before it stops drafting (the exploration a
# fresh request gets), and regains this much per step it decodes without drafts: probes after a
# stop cost it at most this share of its decoding time.
LEDGER_FLOOR = 0.5
PROBE_CREDIT = 0.01
# Per step without drafts, estimates drift this far back toward the prior, so a request that
# stopped speculating (low acceptance) probes again later instead of staying off for good.
ACCEPTANCE_RELAX = 0.01
# Prior chance that a node's second (third, ...) child holds the target's token when the children
# before it do not; learnt per request from the trees it verifies.
BRANCH_PRIOR = 0.25
MAX_RANKS = 8


@dataclass(slots=True)
class SpecState:
    """A request's speculation state: its settings and what it has learnt about acceptance."""

    params: SpecParams
    alpha: list[float] = field(default_factory=list)  # P(draft j accepted | drafts < j accepted)
    # branch[r - 1]: P(the rank-r child is accepted | no child before it was, it exists)
    branch: list[float] = field(default_factory=list)
    k_current: int = 0  # the heuristic controller's running draft length
    # Calibration of the proposer's node scores: at nodes visited, how often some child was accepted
    # against the children's summed scores (EWMAs); their ratio scales a score into a probability.
    score_hits: float = 1.0
    score_mass: float = 1.0
    # Steps speculation has saved this request so far, less the steps its drafts cost (see above).
    ledger: float = 0.0

    def __post_init__(self) -> None:
        self.alpha = [self.params.acceptance_prior] * self.params.k_max
        self.branch = [BRANCH_PRIOR] * MAX_RANKS
        self.k_current = min(max(self.params.num_speculative_tokens, self.params.k_min), self.params.k_max)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A verified chain."""
        visits: list[tuple[int, int | None, float | None]] = [(1, 0, None)] * num_accepted
        if num_accepted < num_drafted:
            visits.append((1, None, None))
        self.observe_walk(visits)

    def observe_walk(self, visits: Sequence[tuple[int, int | None, float | None]]) -> None:
        """A verified draft, as the walk down it: per node visited that has children, how many it has,
        the rank of the one accepted (None: none was) and the children's summed scores (None: the
        proposer gave none)."""
        for _, taken, mass in visits:
            if mass is not None:
                hit = 0.0 if taken is None else 1.0
                self.score_hits += ACCEPTANCE_EWMA * (hit - self.score_hits)
                self.score_mass += ACCEPTANCE_EWMA * (min(1.0, mass) - self.score_mass)
        for j, (num_children, taken, _) in enumerate(visits[: len(self.alpha)]):
            self.alpha[j] += ACCEPTANCE_EWMA * ((1.0 if taken == 0 else 0.0) - self.alpha[j])
            if taken == 0:
                continue
            for r in range(1, min(num_children, MAX_RANKS + 1)):
                hit = 1.0 if taken == r else 0.0
                self.branch[r - 1] += ACCEPTANCE_EWMA * (hit - self.branch[r - 1])
                if hit:
                    break
        if visits:
            full = all(taken is not None for _, taken, _ in visits)
            grown = self.k_current + 2 if full else self.k_current - 1
            self.k_current = min(max(grown, self.params.k_min, 1), self.params.k_max)

    def scored(self, score: float) -> float:
        """P(a node with proposer score `score` is accepted | its parent was), calibrated."""
        trust = min(4.0, max(0.25, self.score_hits / max(self.score_mass, 1e-6)))
        return min(1.0, score * trust)

    def edge(self, depth: int, rank: int) -> float:
        """P(a node's rank-`rank` child, `depth` deep (1: a child of the root), is accepted | the node
        was)."""
        a = self.alpha[min(depth, len(self.alpha)) - 1] if self.alpha else self.params.acceptance_prior
        if rank == 0:
            return a
        p = 1.0 - a
        for r in range(1, rank):
            p *= 1.0 - self.branch[min(r, MAX_RANKS) - 1]
        return p * self.branch[min(rank, MAX_RANKS) - 1]

    def relax(self) -> None:
        prior = self.params.acceptance_prior
        self.alpha = [a + ACCEPTANCE_RELAX * (prior - a) for a in self.alpha]

    def settle(self, accepted: int, extra_steps: float) -> None:
        """A verified draft: `accepted` tokens it saved a step each, against `extra_steps`, the time
        its drafts added to the pass (and to drafting) over the pass's time without them."""
        self.ledger += accepted - extra_steps

    def credit(self) -> None:
        """A step decoded without drafts."""
        self.ledger += PROBE_CREDIT

    @property
    def in_credit(self) -> bool:
        """Whether the goodput controller may draft for this request: speculation has not cost it
        more than LEDGER_FLOOR steps net of the credit it has earned since."""
        return self.ledger > -LEDGER_FLOOR


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
        elif c.state.in_credit:
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
    heap = [
        (-_marginal(candidates[i].state, ks[i]), i) for i in dynamic if ks[i] < _clamp(K_MAX, candidates[i])
    ]
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
        if ks[i] < _clamp(K_MAX, c):
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


@dataclass(slots=True)
class TreeCandidate:
    state: SpecState
    parents: Sequence[
        int
    ]  # the proposer's tree (engine/spec_decode/draft_tree.py), at most the k chosen deep
    cap: int  # at most this many nodes in all (KV room)
    scores: Sequence[float] | None = None  # the proposer's per-node scores (Proposal.scores)


def grow_trees(
    candidates: Sequence[TreeCandidate],
    num_emitting: int,
    num_tokens: int,
    budget: int,
    cost: CostModel,
    context: float = 0.0,
) -> list[list[int]]:
    """Nodes to verify per candidate (ascending, closed under ancestors): each one's first path (the
    chain choose_k paid for), then branch nodes across the batch, best expected gain first, while one
    more token in a step of `num_tokens` tokens (chains included) emitting `num_emitting` raises
    expected goodput; at most `budget` nodes added in all."""
    kept: list[set[int]] = []
    gains: list[list[float]] = []
    kids: list[dict[int, list[int]]] = []
    expected = float(num_emitting)
    heap: list[tuple[float, int, int]] = []
    for ci, c in enumerate(candidates):
        kid = children(c.parents)
        kids.append(kid)
        depth, rank = depths(c.parents), ranks(c.parents)
        gain: list[float] = []
        for i, p in enumerate(c.parents):
            edge = c.state.edge(depth[i], rank[i]) if c.scores is None else c.state.scored(c.scores[i])
            gain.append((1.0 if p < 0 else gain[p]) * edge)
        gains.append(gain)
        chain = set(first_path(c.parents)[: c.cap])
        kept.append(chain)
        expected += sum(gain[i] for i in chain)
        for node in (-1, *chain):
            for child in kid.get(node, []):
                if child not in chain:
                    heapq.heappush(heap, (-gain[child], ci, child))
    total = num_tokens
    step = cost.forward_time(total, context)
    added = 0
    while heap and added < budget:
        neg_gain, ci, node = heapq.heappop(heap)
        if len(kept[ci]) >= candidates[ci].cap:
            continue
        new_step = cost.forward_time(total + 1, context)
        if (expected - neg_gain) * step <= expected * new_step:
            break  # the best remaining node does not pay; nor does any other
        kept[ci].add(node)
        total += 1
        added += 1
        expected -= neg_gain
        step = new_step
        for child in kids[ci].get(node, []):
            heapq.heappush(heap, (-gains[ci][child], ci, child))
    return [sorted(k) for k in kept]
