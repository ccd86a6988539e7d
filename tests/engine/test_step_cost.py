"""The one step-cost curve (engine/step_cost.py) the engine's controller and the routing policy
share."""

from __future__ import annotations

import random

import pytest

from specgate.engine.step_cost import StepCost, expected_accepted


def linear(n: float) -> float:
    """A step that costs 10 ms plus 0.5 ms per token: memory-bound at first, compute-bound later."""
    return 10.0 + 0.5 * n


def exact(fn=linear) -> StepCost:  # type: ignore[no-untyped-def]
    tokens = [2**i for i in range(13)]
    return StepCost(tokens, [fn(t) for t in tokens], 1000)


def test_expected_accepted_drafts() -> None:
    assert expected_accepted(0.5, 1) == pytest.approx(0.5)
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4.0 and expected_accepted(0.7, 0) == 0.0


def test_fit_recovers_the_curve_from_noisy_steps() -> None:
    rng = random.Random(0)
    steps = []
    for _ in range(3000):
        n = rng.choice([1, 3, 5, 8, 16, 24, 40, 64, 100, 128, 256])
        steps.append((n, linear(n) * rng.lognormvariate(0.0, 0.1)))
    cost = StepCost.fit(steps)
    assert cost is not None and cost.n_steps == 3000
    assert all(b >= a for a, b in zip(cost.ms, cost.ms[1:], strict=False))  # never cheaper with more
    for n in (1, 8, 50, 128, 256, 600):
        assert cost.at(n) == pytest.approx(linear(n), rel=0.12), n
    assert StepCost.fit(steps[:10]) is None  # too few to say anything
    assert StepCost.fit([(0, 5.0), (3, float("nan")), (4, -1.0)] * 40) is None  # nothing valid


def test_a_curve_fitted_on_verification_steps_alone_prices_a_one_token_step() -> None:
    # Speculative steps hold 2+ tokens; plain decoding's 1-token step is priced along the first
    # measured segment (not as the cheapest measured step, which would inflate every gain at batch 1).
    steps = [(n, linear(n)) for n in (2, 4, 8, 16) for _ in range(15)]
    cost = StepCost.fit(steps)
    assert cost is not None and cost.tokens[0] == 2
    assert cost.at(1) == pytest.approx(linear(1), rel=0.01)
    want = (1 + expected_accepted(0.7, 3)) * linear(1) / linear(4)
    assert cost.gain(1, 3, 0.7) == pytest.approx(want, rel=0.02)
    # Never below a cost proportional to tokens, however steep the first segment.
    steep = StepCost([4, 8], [10.0, 40.0], 100)
    assert steep.at(2) == pytest.approx(5.0) and steep.at(4) == 10.0
    assert StepCost([4], [10.0], 100).at(1) == 10.0  # one point: flat


def test_crossover_is_where_no_draft_length_pays() -> None:
    cost = exact()
    for p, k_max in ((0.7, 4), (0.5, 8), (0.9, 3)):
        want = next(b for b in range(1, 5000) if not pays(b, p, k_max))
        assert cost.crossover(p, k_max) == want, (p, k_max)
        assert cost.best_k(want - 1, p, k_max) > 0 and cost.best_k(want, p, k_max) == 0
    # A flat cost (memory-bound at every size measured... and beyond) always pays.
    assert exact(lambda n: 20.0).crossover(0.6, 4) is None


def pays(batch: int, p: float, k_max: int) -> bool:
    """Brute force on the exact curve: some draft length beats plain decoding at this batch."""
    return any(
        (1 + expected_accepted(p, k)) * linear(batch) > linear(batch * (k + 1)) for k in range(1, k_max + 1)
    )
