"""The engine's online cost model (engine/spec_decode/cost_model.py): forward passes priced by the
step-cost curve the routing policy fits too (engine/step_cost.py), per context length, over a window
of recent passes; drafting time per proposer."""

from __future__ import annotations

import random

import pytest

from specgate.engine.spec_decode.controller import Candidate, SpecState, choose_k
from specgate.engine.spec_decode.cost_model import PRIOR_MARGINAL_FRACTION, WINDOW, CostModel
from specgate.engine.step_cost import StepCost
from specgate.engine.vocab import SpecParams
from tests.engine.test_step_cost import linear


def test_cost_model_prior_before_any_measurement() -> None:
    cost = CostModel()
    assert cost.forward_time(1) == pytest.approx(1.0)
    assert cost.forward_time(11) == pytest.approx(1.3)
    assert cost.draft_time("ngram") == 0.0


def test_the_median_of_a_bucket_resists_a_single_outlier() -> None:
    cost = CostModel()
    for s in (0.010, 0.011, 5.0, 0.012, 0.010):
        cost.observe_forward(8, s)
    assert cost.forward_time(8) == pytest.approx(0.011)
    cost.observe_forward(8, 0.012)
    assert cost.forward_time(8) == pytest.approx(0.0115)


def test_a_bucket_forgets_old_samples() -> None:
    cost = CostModel()
    for _ in range(15):
        cost.observe_forward(4, 1.0)
    for _ in range(15):
        cost.observe_forward(4, 2.0)
    assert cost.forward_time(4) == pytest.approx(2.0)


def test_draft_time_is_an_ewma_per_step_and_per_method() -> None:
    cost = CostModel()
    cost.observe_draft("d", 4, 0.4)
    assert cost.draft_time("d") == pytest.approx(0.1)
    cost.observe_draft("d", 2, 0.6)
    assert cost.draft_time("d") == pytest.approx(0.1 + 0.2 * (0.3 - 0.1))
    cost.observe_draft("d", 0, 5.0)  # no steps: ignored
    assert cost.draft_time("d") == pytest.approx(0.14)
    assert cost.draft_time("other") == 0.0


def test_cost_model_keeps_long_and_short_contexts_apart() -> None:
    cost = CostModel()
    for _ in range(3):
        cost.observe_forward(1, 0.020, context=100)
        cost.observe_forward(5, 0.021, context=100)
        cost.observe_forward(1, 0.024, context=1000)
        cost.observe_forward(5, 0.031, context=1000)
    assert cost.forward_time(5, context=100) == pytest.approx(0.021)
    assert cost.forward_time(5, context=1000) == pytest.approx(0.031)
    # Verification looks dearer at a long context, so the same acceptance buys less k there.
    state = SpecState(SpecParams(method="ngram", k_max=8, acceptance_prior=0.3))
    cand = Candidate(state, "ngram", False, 8)
    (k_short,) = choose_k([cand], 1, 1, 64, cost, context=100)
    (k_long,) = choose_k([cand], 1, 1, 64, cost, context=1000)
    assert k_short > k_long
    # A context never measured borrows the nearest measured one.
    assert cost.forward_time(1, context=5000) == pytest.approx(0.024)


def test_the_engine_prices_a_pass_by_the_curve_the_policy_fits() -> None:
    # The same passes, fed to the engine's cost model and fitted as a retrain fits telemetry rows,
    # give the same prices: one cost model, not two.
    rng = random.Random(1)
    cost = CostModel()
    rows = []
    for _ in range(WINDOW):
        for n in (1, 2, 3, 4, 6, 8, 16, 32):
            ms = linear(n) * rng.lognormvariate(0.0, 0.05)
            cost.observe_forward(n, ms / 1e3)
            rows.append((n, ms))
    fitted = StepCost.fit(rows)
    assert fitted is not None and cost.curve() == fitted
    for n in (1, 5, 7, 12, 24, 64):
        assert cost.forward_time(n) == pytest.approx(fitted.at(n) / 1e3)


def test_a_stalled_pass_does_not_price_its_size_until_the_size_is_measured_again() -> None:
    cost = CostModel()
    for _ in range(5):
        cost.observe_forward(1, linear(1) / 1e3)
        cost.observe_forward(8, linear(8) / 1e3)
    cost.observe_forward(4, 1.0)  # one stall: a second for what costs 12 ms
    assert cost.forward_time(4) == pytest.approx((linear(1) + 3 * (linear(8) - linear(1)) / 7) / 1e3)
    for _ in range(2):
        cost.observe_forward(4, linear(4) / 1e3)
    assert cost.forward_time(4) == pytest.approx(linear(4) / 1e3)  # the median of three


def test_before_two_sizes_are_measured_the_prior_marginal_prices_longer_passes() -> None:
    cost = CostModel()
    assert cost.curve() is None
    assert cost.forward_time(5) == pytest.approx(1.0 + 4 * PRIOR_MARGINAL_FRACTION)  # relative units
    for _ in range(3):
        cost.observe_forward(1, 0.020)
    assert cost.forward_time(1) == pytest.approx(0.020)
    assert cost.forward_time(9) == pytest.approx(0.020 * (1 + 8 * PRIOR_MARGINAL_FRACTION))


def test_the_window_follows_a_machine_that_slows_down() -> None:
    cost = CostModel()
    for _ in range(WINDOW):
        cost.observe_forward(2, 0.010)
    for _ in range(WINDOW // 2 + 1):
        cost.observe_forward(2, 0.020)
    assert cost.forward_time(2) == pytest.approx(0.020)


def test_one_size_measured_at_a_context_borrows_the_growth_of_another() -> None:
    # Decoding alone measures one size at a long context; how longer passes grow is what the
    # products do, measured at a short context (prefill chunks, earlier verification).
    cost = CostModel()
    for _ in range(3):
        cost.observe_forward(1, 0.040, context=2000)
        cost.observe_forward(1, 0.030, context=50)
        cost.observe_forward(9, 0.060, context=50)
    assert cost.forward_time(5, context=2000) == pytest.approx(0.040 * 0.045 / 0.030)


def test_one_large_pass_measured_does_not_price_small_ones_at_its_cost() -> None:
    # A fresh engine at 16 in flight: the first pass at a context is a 512-token prefill chunk. A
    # 16-token decode step there, and drafts added to it, must not cost what the chunk cost (drafts
    # would look free: every request drafted its whole k_max).
    cost = CostModel()
    for _ in range(3):
        cost.observe_forward(512, 1.5, context=300)
    assert cost.forward_time(512, context=300) == pytest.approx(1.5)
    small = cost.forward_time(16, context=300)
    prior = [1 + (n - 1) * PRIOR_MARGINAL_FRACTION for n in (16, 512)]
    assert small == pytest.approx(1.5 * prior[0] / prior[1])
    assert cost.forward_time(144, context=300) > 2 * small  # eight drafts for each of 16 requests
    # With the products' growth measured at another context, that shape scales it instead.
    for _ in range(3):
        cost.observe_forward(16, 0.070, context=50)
        cost.observe_forward(512, 1.4, context=50)
    assert cost.forward_time(16, context=300) == pytest.approx(1.5 * 0.070 / 1.4)
