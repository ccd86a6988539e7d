"""Draft-length controllers and the cost model behind the goodput controller.

Costs come from a CostModel subclass with fixed functions, never from this machine's timing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from specgate.engine.spec_decode.controller import (
    ACCEPTANCE_EWMA,
    LEDGER_FLOOR,
    PROBE_CREDIT,
    Candidate,
    SpecState,
    choose_k,
)
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.vocab import SpecParams


class FixedCosts(CostModel):
    def __init__(self, forward: Callable[[int], float], draft: float = 0.0) -> None:
        super().__init__()
        self.forward = forward
        self.draft = draft

    def forward_time(self, num_tokens: int, context: float = 0.0) -> float:
        return self.forward(num_tokens)

    def draft_time(self, method: str) -> float:
        return self.draft


def linear(n: int) -> float:
    """Each extra token adds 3% of a one-token step."""
    return 1.0 + 0.03 * (n - 1)


def compounding(n: int) -> float:
    """Each extra token adds 3% to the step."""
    return 1.03 ** (n - 1)


def state(**params: Any) -> SpecState:
    return SpecState(SpecParams(method="m", **params))


def cand(prior: float = 0.6, k_cap: int = 64, autoregressive: bool = False, **params: Any) -> Candidate:
    return Candidate(state(acceptance_prior=prior, **params), "m", autoregressive, k_cap)


def accepted_prefix(rng: random.Random, k: int, p: float) -> int:
    """Drafts accepted in a row, each with probability p, until the first rejection."""
    n = 0
    while n < k and rng.random() < p:
        n += 1
    return n


def simulate(p: float, prior: float, steps: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    c = cand(prior, k_max=8)
    cost = FixedCosts(linear)
    ks = []
    for _ in range(steps):
        (k,) = choose_k([c], num_emitting=1, num_tokens=1, budget=64, cost=cost)
        ks.append(k)
        if k:
            c.state.observe(k, accepted_prefix(rng, k, p))
    return ks


# ---- SpecState --------------------------------------------------------------------------------


def test_observe_updates_the_ewma_of_each_position_reached() -> None:
    s = state(k_max=4, acceptance_prior=0.5)
    s.observe(3, 1)
    up = 0.5 + ACCEPTANCE_EWMA * 0.5
    down = 0.5 - ACCEPTANCE_EWMA * 0.5
    assert s.alpha == pytest.approx([up, down, 0.5, 0.5])  # position 2 was drafted but never judged
    s.observe(2, 2)
    assert s.alpha == pytest.approx(
        [up + ACCEPTANCE_EWMA * (1 - up), down + ACCEPTANCE_EWMA * (1 - down), 0.5, 0.5]
    )
    s.observe(4, 0)
    assert s.alpha[0] == pytest.approx((up + ACCEPTANCE_EWMA * (1 - up)) * (1 - ACCEPTANCE_EWMA))
    assert s.alpha[1:] == pytest.approx([down + ACCEPTANCE_EWMA * (1 - down), 0.5, 0.5])


def test_observe_converges_toward_the_observed_rates() -> None:
    s = state(k_max=3, acceptance_prior=0.5)
    for _ in range(100):
        s.observe(3, 3)
    assert s.alpha == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    for _ in range(100):
        s.observe(3, 0)
    assert s.alpha[0] == pytest.approx(0.0, abs=1e-6)
    assert s.alpha[1:] == pytest.approx([1.0, 1.0], abs=1e-6)


def test_observe_without_drafts_changes_nothing() -> None:
    s = state(k_max=4, num_speculative_tokens=3)
    s.observe(0, 0)
    assert s.alpha == [0.6] * 4 and s.k_current == 3


def test_heuristic_schedule_adds_two_on_full_acceptance_and_drops_one_otherwise() -> None:
    s = state(k_max=6, num_speculative_tokens=3)
    assert s.k_current == 3
    s.observe(3, 3)
    assert s.k_current == 5
    s.observe(5, 5)
    assert s.k_current == 6  # clamped to k_max
    s.observe(6, 5)
    assert s.k_current == 5
    for _ in range(10):
        s.observe(s.k_current, 0)
    assert s.k_current == 1  # never below 1 ...
    s = state(k_min=2, k_max=6, num_speculative_tokens=3)
    for _ in range(10):
        s.observe(s.k_current, 0)
    assert s.k_current == 2  # ... nor below k_min


def test_initial_k_current_is_clamped_to_k_min_and_k_max() -> None:
    assert state(k_max=6, num_speculative_tokens=10).k_current == 6
    assert state(k_min=2, k_max=6, num_speculative_tokens=0).k_current == 2
    assert state(k_max=6, num_speculative_tokens=4).k_current == 4


# ---- choose_k ---------------------------------------------------------------------------------


def test_goodput_k_rises_to_k_max_under_high_acceptance() -> None:
    ks = simulate(p=0.9, prior=0.3, steps=200)
    assert ks[0] <= 3  # a pessimistic prior starts short
    assert ks[-20:] == [8] * 20
    assert sum(ks[:20]) < sum(ks[-20:])


def test_goodput_k_falls_to_zero_under_low_acceptance() -> None:
    ks = simulate(p=0.05, prior=0.6, steps=100)
    assert ks[0] >= 3  # an optimistic prior starts long
    assert ks[-20:] == [0] * 20


def test_a_large_batch_does_not_speculate_at_moderate_acceptance() -> None:
    cost = FixedCosts(compounding)
    batch = [cand(0.5) for _ in range(32)]
    assert choose_k(batch, num_emitting=32, num_tokens=32, budget=512, cost=cost) == [0] * 32
    (k,) = choose_k([cand(0.5)], num_emitting=1, num_tokens=1, budget=512, cost=cost)
    assert k > 0


def test_static_controller_drafts_num_speculative_tokens_clamped() -> None:
    cost = FixedCosts(linear)
    static = {"controller": "static", "num_speculative_tokens": 5}
    # Acceptance does not matter to the static controller.
    assert choose_k([cand(0.0, k_max=8, **static)], 1, 1, 64, cost) == [5]
    assert choose_k([cand(0.0, k_cap=3, k_max=8, **static)], 1, 1, 64, cost) == [3]
    assert choose_k([cand(0.0, k_max=4, **static)], 1, 1, 64, cost) == [4]
    assert choose_k([cand(0.0, k_cap=0, **static)], 1, 1, 64, cost) == [0]


def test_heuristic_controller_drafts_k_current_clamped() -> None:
    c = cand(0.0, controller="heuristic", num_speculative_tokens=3, k_max=8)
    cost = FixedCosts(linear)
    assert choose_k([c], 1, 1, 64, cost) == [3]
    c.state.observe(3, 3)
    assert choose_k([c], 1, 1, 64, cost) == [5]
    c.k_cap = 4
    assert choose_k([c], 1, 1, 64, cost) == [4]


def test_goodput_honours_k_min() -> None:
    cost = FixedCosts(linear)
    # Nothing is ever accepted: without k_min the goodput controller drafts nothing.
    assert choose_k([cand(0.0)], 1, 1, 64, cost) == [0]
    assert choose_k([cand(0.0, k_min=2)], 1, 1, 64, cost) == [2]
    assert choose_k([cand(0.0, k_min=2, k_cap=1)], 1, 1, 64, cost) == [1]  # the hard cap wins
    assert choose_k([cand(1.0, k_min=2, k_max=5)], 1, 1, 64, cost) == [5]  # a floor, not a ceiling


def test_the_budget_caps_the_total() -> None:
    free = FixedCosts(lambda n: 1.0)
    ks = choose_k([cand(1.0) for _ in range(4)], 4, 4, budget=10, cost=free)
    assert sum(ks) == 10 and all(0 <= k <= 8 for k in ks)
    assert choose_k([cand(1.0) for _ in range(4)], 4, 4, budget=0, cost=free) == [0] * 4
    assert choose_k([cand(0.0, k_min=3) for _ in range(2)], 2, 2, budget=4, cost=free) in (
        [3, 1],
        [1, 3],
        [2, 2],
    )
    # Fixed-length controllers alone overflowing the budget are shrunk, the longest first.
    static = [cand(controller="static", num_speculative_tokens=n) for n in (6, 2)]
    assert choose_k(static, 2, 2, budget=4, cost=free) == [2, 2]
    static = [cand(controller="static", num_speculative_tokens=4) for _ in range(3)]
    assert sum(choose_k(static, 3, 3, budget=5, cost=free)) == 5
    # Fixed-length drafts come first; the goodput controller gets what they leave.
    mixed = [cand(controller="static", num_speculative_tokens=3), cand(1.0)]
    assert choose_k(mixed, 2, 2, budget=5, cost=free) == [3, 2]


def test_goodput_counts_the_expected_tokens_of_fixed_length_drafts() -> None:
    # A static request whose 8 drafts are always accepted: with the other request's token the step
    # already emits 10 tokens. At 3% of a one-token step per extra token, a draft accepted with
    # probability 0.2 lowers goodput: (2 + 8 + 0.2) / 1.30 = 7.85 < (2 + 8) / 1.27 = 7.87.
    static = cand(1.0, controller="static", num_speculative_tokens=8)
    dynamic = cand(0.2)
    ks = choose_k([static, dynamic], num_emitting=2, num_tokens=2, budget=64, cost=FixedCosts(linear))

    def goodput(k: int) -> float:
        return (2 + 8 + sum(0.2 ** (j + 1) for j in range(k))) / linear(2 + 8 + k)

    assert goodput(0) > goodput(1)
    assert ks == [8, 0]


def test_k_cap_caps_each_request() -> None:
    free = FixedCosts(lambda n: 1.0)
    ks = choose_k([cand(1.0, k_cap=cap) for cap in (2, 5, 0, 64)], 4, 4, budget=64, cost=free)
    assert ks == [2, 5, 0, 8]  # the last one is held by k_max


@pytest.mark.parametrize("autoregressive", [False, True])
def test_an_expensive_proposer_gets_no_draft(autoregressive: bool) -> None:
    # Drafting costs as much as a forward pass: no acceptance short of certainty pays for it.
    c = cand(0.8, autoregressive=autoregressive)
    assert choose_k([c], 1, 1, 64, FixedCosts(linear, draft=1.0)) == [0]
    assert choose_k([c], 1, 1, 64, FixedCosts(linear, draft=0.0)) != [0]


def test_a_lookup_proposer_pays_its_drafting_cost_once_per_step() -> None:
    # An autoregressive drafter pays per token, so it stops sooner than a lookup at the same cost.
    cost = FixedCosts(linear, draft=0.3)
    (lookup,) = choose_k([cand(0.8, autoregressive=False)], 1, 1, 64, cost)
    (drafter,) = choose_k([cand(0.8, autoregressive=True)], 1, 1, 64, cost)
    assert lookup == 8
    assert 0 < drafter < lookup


def test_a_request_that_stopped_speculating_probes_again_later() -> None:
    """Low acceptance turns drafting off; with no drafts, estimates drift back to the prior, so
    after a while the request drafts again instead of staying off for good."""
    state = SpecState(SpecParams(method="ngram", k_max=4, acceptance_prior=0.6))
    cand = Candidate(state, "ngram", False, 8)
    cost = FixedCosts(linear)
    for _ in range(30):
        state.observe(1, 0)
    assert choose_k([cand], 1, 1, 64, cost) == [0]
    steps = 0
    while choose_k([cand], 1, 1, 64, cost) == [0]:
        state.relax()
        steps += 1
        assert steps < 1000
    assert steps >= 3  # not at once: a cold request stays off for a while


def _run(state: SpecState, cost: FixedCosts, accept: Callable[[int], int], steps: int) -> tuple[int, float]:
    """Decode `steps` steps of one request, the way the engine settles them: (drafting steps, net
    steps lost to speculation)."""
    cand = Candidate(state, "ngram", False, 64)
    drafting, lost = 0, 0.0
    for _ in range(steps):
        (k,) = choose_k([cand], 1, 1, 64, cost)
        if k == 0:
            state.relax()
            state.credit()
            continue
        drafting += 1
        accepted = accept(k)
        extra = (cost.forward_time(1 + k) - cost.forward_time(1)) / cost.forward_time(1)
        state.observe(k, accepted)
        state.settle(accepted, extra)
        lost += extra - accepted
    return drafting, lost


def test_a_request_whose_drafts_fail_stops_within_a_few_steps_and_then_only_probes() -> None:
    # k_min 1 (what the default rules hand the engine) used to force a draft every step whatever
    # the acceptance: a request on which drafts never land lost 3% of a step per step, for good.
    state = SpecState(SpecParams(method="ngram", k_min=1, k_max=8, acceptance_prior=0.6))
    cost = FixedCosts(linear)
    first, lost_first = _run(state, cost, lambda k: 0, 20)
    assert first <= 10 and lost_first <= LEDGER_FLOOR + 8 * 0.03
    drafting, lost = _run(state, cost, lambda k: 0, 1000)
    assert drafting >= 1  # it still probes
    assert lost <= PROBE_CREDIT * 1000 + 0.5  # and its probes cost it at most the credit
    assert drafting < 1000 // 2


def test_a_probe_that_lands_resumes_drafting() -> None:
    state = SpecState(SpecParams(method="ngram", k_min=1, k_max=8, acceptance_prior=0.6))
    cost = FixedCosts(linear)
    _run(state, cost, lambda k: 0, 50)
    assert state.ledger < 0
    drafting, lost = _run(state, cost, lambda k: k, 50)  # the text turns copyable
    assert drafting >= 45 and lost < 0


def test_a_request_whose_drafts_land_is_never_held_back() -> None:
    state = SpecState(SpecParams(method="ngram", k_min=0, k_max=8, acceptance_prior=0.6))
    drafting, lost = _run(state, FixedCosts(linear), lambda k: k, 200)
    assert drafting == 200 and lost < -100
