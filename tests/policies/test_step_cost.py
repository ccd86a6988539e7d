"""The measured step cost and the crossover batch (policies/step_cost.py), and the policies using it."""

from __future__ import annotations

import json
import random
import re

import pytest

from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.load import Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.step_cost import StepCost, expected_accepted
from specgate.policies.training.retrain import retrain
from tests.policies import synthetic_telemetry as synth

ARMS = [Arm("embedded", "off"), Arm("embedded", "ngram")]
SPEC_OFF_MARK = re.compile(r".*: speculation off.*")  # the dashboard's LIKE '%: speculation off%'


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


def ctx(label: str, batch: int) -> DecisionContext:
    return DecisionContext(label, 0.95, {"temperature": 0.0}, Load(running=batch), list(ARMS))


def test_the_policy_follows_the_measured_crossover_not_the_constant() -> None:
    cost = exact()
    priors = {"code:ngram": 0.7}
    crossover = cost.crossover(0.7, 8)
    assert crossover is not None and 4 < crossover < 64
    # The constant would turn speculation off at 2; the measurements say it pays until the crossover.
    rules = RuleConfig(max_batch_for_spec=2, exploration_rate=0.0)
    policy = RulePolicy(rules, priors, seed=0, cost=cost)
    below = policy.decide(ctx("code", crossover - 2), explore=False)  # this request makes it crossover - 1
    assert below.arm.method == "ngram"
    assert 1 <= below.k_max <= 8 and below.k_max == cost.best_k(crossover - 1, 0.7, 8)
    above = policy.decide(ctx("code", crossover), explore=False)
    assert above.arm.method == "off" and SPEC_OFF_MARK.match(above.reason), above.reason
    # Without measurements the constant still guards.
    assert RulePolicy(rules, priors, seed=0).decide(ctx("code", 4), explore=False).arm.method == "off"


def test_retrain_fits_the_curve_and_a_version_keeps_it() -> None:
    steps = [(n, linear(n)) for n in (1, 2, 4, 8, 16, 32, 64, 128) for _ in range(10)]
    result = retrain(synth.rows(800, seed=7), RuleConfig(), PolicyState(), steps=steps)
    assert result.state.step_cost is not None and result.state.step_cost.n_steps == 80
    back = PolicyState.from_dict(json.loads(json.dumps(result.state.as_dict())))
    assert back.step_cost == result.state.step_cost
    # Too few new steps: the current curve stays.
    kept = retrain(synth.rows(800, seed=8), RuleConfig(), result.state, steps=steps[:5])
    assert kept.state.step_cost == result.state.step_cost
