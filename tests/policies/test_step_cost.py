"""The routing policies on the measured step cost (engine/step_cost.py): the crossover batch they
follow, and the curve a retrain fits and a policy version keeps."""

from __future__ import annotations

import json
import re

from specgate.engine.vocab import LoadSnapshot
from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.load import Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.training.retrain import retrain
from tests.engine.test_step_cost import exact, linear
from tests.policies import synthetic_telemetry as synth

ARMS = [Arm("embedded", "off"), Arm("embedded", "ngram")]
SPEC_OFF_MARK = re.compile(r".*: speculation off.*")  # the dashboard's LIKE '%: speculation off%'


def ctx(label: str, batch: int) -> DecisionContext:
    return DecisionContext(
        label, 0.95, {"temperature": 0.0}, Load(LoadSnapshot(num_running=batch)), list(ARMS)
    )


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
    assert 1 <= below.spec.k_max <= 8 and below.spec.k_max == cost.best_k(crossover - 1, 0.7, 8)
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
