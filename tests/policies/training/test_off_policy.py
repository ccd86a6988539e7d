"""Propensities the policies log, and the off-policy estimators that read them (training/off_policy.py)."""

from __future__ import annotations

import collections
import math
import random

import pytest

from specgate.engine.vocab import LoadSnapshot
from specgate.policies.arms import Arm
from specgate.policies.decision import Decision, DecisionContext
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel, TrainingRow
from specgate.policies.learned_policy import LearnedPolicy
from specgate.policies.load import Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from specgate.policies.training.off_policy import compare, doubly_robust, ips, reward_model, snips, terms
from tests.policies import synthetic_telemetry as synth

ARMS = ["embedded:off", "embedded:ngram"]
NOISE = 0.1  # synthetic rows: log-normal noise on goodput (synth.rows)


def ctx(label: str, arms: list[str], running: int = 4) -> DecisionContext:
    feats = synth.features(label, running, random.Random(1))
    return DecisionContext(
        label, 0.95, feats, Load(LoadSnapshot(num_running=running)), [Arm.parse(a) for a in arms]
    )


def frequencies(
    policy: RulePolicy | LearnedPolicy, c: DecisionContext, n: int
) -> tuple[dict[str, float], dict[str, float]]:
    """How often each arm was taken over `n` decisions, and the propensity logged with it."""
    counts: collections.Counter[str] = collections.Counter()
    logged: dict[str, set[float]] = collections.defaultdict(set)
    for _ in range(n):
        d = policy.decide(c)
        counts[d.arm.key] += 1
        logged[d.arm.key].add(d.propensity)
    assert all(len(v) == 1 for v in logged.values()), logged  # one state, one context: one propensity
    return {a: k / n for a, k in counts.items()}, {a: next(iter(v)) for a, v in logged.items()}


def test_rule_policy_logs_the_probability_of_what_it_chose() -> None:
    rules = RuleConfig(exploration_rate=0.3, exploration_cap=1.0)
    policy = RulePolicy(rules, budget=ExplorationBudget(1.0), seed=0)
    arms = ["embedded:off", "embedded:ngram", "embedded:suffix"]
    freq, prop = frequencies(policy, ctx("code", arms), 20_000)
    assert prop == pytest.approx({"embedded:ngram": 0.7, "embedded:off": 0.15, "embedded:suffix": 0.15})
    for arm, p in prop.items():
        assert freq[arm] == pytest.approx(p, abs=0.015)
    # Without exploration (evaluation), or with the budget spent, the choice is certain.
    assert policy.decide(ctx("code", arms), explore=False).propensity == 1.0
    spent = RulePolicy(rules, budget=ExplorationBudget(0.0), seed=0)
    assert {spent.decide(ctx("code", arms)).propensity for _ in range(50)} == {1.0}


@pytest.fixture(scope="module")
def model() -> GoodputModel:
    return GoodputModel.fit(synth.rows(600, seed=3), min_arm_rows=20)


@pytest.mark.slow
def test_learned_policy_propensities_match_its_thompson_draws_and_exploration(model: GoodputModel) -> None:
    # A wide posterior (thompson_scale 8) so that both modelled arms are sampled often, and one
    # unmodelled arm that exploration reaches.
    rules = RuleConfig(exploration_rate=0.1, exploration_cap=1.0, thompson_scale=8.0)
    policy = LearnedPolicy(rules, model, budget=ExplorationBudget(1.0), seed=0)
    arms = ["embedded:off", "embedded:ngram", "embedded:suffix"]
    freq, prop = frequencies(policy, ctx("code", arms, running=10), 20_000)
    assert set(freq) == set(arms), freq
    assert prop["embedded:suffix"] == pytest.approx(0.1)
    assert sum(prop.values()) == pytest.approx(1.0, abs=0.03)
    for arm, p in prop.items():  # Thompson shares are estimated on 512 fixed draws
        assert freq[arm] == pytest.approx(p, abs=0.04), (arm, freq, prop)


class ByClass:
    """A deterministic policy: `ngram` on the classes given, `off` elsewhere."""

    kind = "rules"

    def __init__(self, *ngram_on: str) -> None:
        self.ngram_on = set(ngram_on)

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision:
        method = "ngram" if ctx.label in self.ngram_on else "off"
        return Decision(Arm("embedded", method), "by class")


def logged(n: int, p_ngram: float, seed: int) -> list[TrainingRow]:
    """Synthetic requests routed by a logging policy that takes ngram with probability `p_ngram`."""
    rng = random.Random(seed)
    out = []
    for i, row in enumerate(synth.rows(n, seed=seed)):
        arm = "embedded:ngram" if rng.random() < p_ngram else "embedded:off"
        running = int(row.features["load_running"])
        tps = synth.true_goodput(arm, row.label or "", running) * math.exp(rng.gauss(0.0, NOISE))
        p = p_ngram if arm.endswith("ngram") else 1.0 - p_ngram
        out.append(TrainingRow(arm, row.features, tps, 1000.0 / tps, row.label, float(i), propensity=p))
    return out


def truth(policy: ByClass, rows: list[TrainingRow]) -> float:
    """The policy's expected goodput on these requests, from the synthetic world's own law."""
    total = 0.0
    for row in rows:
        arm = policy.decide(ctx(row.label or "", ARMS), explore=False).arm.key
        total += synth.true_goodput(arm, row.label or "", int(row.features["load_running"]))
    return total / len(rows) * math.exp(NOISE**2 / 2)


def test_ips_and_doubly_robust_find_a_policys_value_from_another_policys_traffic() -> None:
    train, held = logged(600, p_ngram=0.7, seed=11), logged(1500, p_ngram=0.7, seed=12)
    target = ByClass("code")  # ngram where it doubles goodput, off where it halves it
    t = terms(target, held, ARMS, reward_model(GoodputModel.fit(train, 20), train))
    true = truth(target, held)
    i, dr = ips(t), doubly_robust(t)
    assert i.low <= true <= i.high, (true, i)
    assert dr.low <= true <= dr.high, (true, dr)
    assert dr.high - dr.low < 0.5 * (i.high - i.low)  # the reward model removes most of IPS's noise
    assert snips(t) == pytest.approx(true, rel=0.1)
    assert t.matched == sum(1 for r in held if r.arm == target.decide(ctx(r.label or "", ARMS)).arm.key)


def test_compare_promotes_only_a_policy_that_is_better_beyond_doubt() -> None:
    train, held = logged(600, p_ngram=0.5, seed=21), logged(1000, p_ngram=0.5, seed=22)
    predict = reward_model(GoodputModel.fit(train, 20), train)
    good, bad = ByClass("code"), ByClass("open_chat")
    good_t, bad_t = terms(good, held, ARMS, predict), terms(bad, held, ARMS, predict)
    better = compare(good_t, bad_t)
    assert better.low > 0 and better.value == pytest.approx(truth(good, held) - truth(bad, held), rel=0.15)
    assert compare(bad_t, good_t).high < 0
    same = compare(good_t, terms(ByClass("code"), held, ARMS, predict))
    assert same.value == same.low == same.high == 0.0  # a tie is never above zero
    # Rows logged before propensities were recorded take no part.
    unlogged = [TrainingRow(r.arm, r.features, r.tokens_per_s, r.tpot_ms, r.label) for r in held[:10]]
    assert len(terms(good, [*unlogged, *held], ARMS, predict).dr) == len(held)
