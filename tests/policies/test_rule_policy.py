"""The default rule policy: per-class arms, the published-evidence rules, guards and exploration."""

from __future__ import annotations

import json

import pytest

from specgate.engine.step_cost import StepCost
from specgate.engine.vocab import LoadSnapshot, SpecParams
from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.guards import safe_arms
from specgate.policies.load import BackendLoad, Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState

EMBEDDED = [Arm("embedded", "off"), Arm("embedded", "ngram"), Arm("embedded", "suffix")]
PLAIN_AND_NGRAM = [Arm("embedded", "off"), Arm("embedded", "ngram")]
LOAD_OFF = ": speculation off"  # the dashboard's mark of a load turn-off (spec_series.LOAD_OFF_MARK)


def steep() -> StepCost:
    """A step of 10 ms plus 5 ms per token: at batch 1 one draft pays only above acceptance 1/3, and
    at 0.12 no draft length does; at 0.8, K 3 pays most."""
    tokens = [2**i for i in range(8)]
    return StepCost(tokens, [10.0 + 5.0 * t for t in tokens], 1000)


def ctx(label: str, conf: float = 0.95, temperature: float = 0.0, load: Load | None = None,
        arms: list[Arm] | None = None, tools: bool = False) -> DecisionContext:  # fmt: skip
    feats = {"temperature": temperature, "tools_or_json": float(tools)}
    return DecisionContext(label, conf, feats, load or Load(), arms or list(EMBEDDED))


def decide(c: DecisionContext, rules: RuleConfig | None = None) -> str:
    return RulePolicy(rules or RuleConfig(), seed=0).decide(c, explore=False).arm.key


@pytest.mark.parametrize("label", ["code", "tool_call", "summarization", "rag"])
def test_speculates_where_the_evidence_says_it_pays(label: str) -> None:
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx(label), explore=False)
    assert d.arm.speculative and (d.spec.k_min, d.spec.k_max) == (0, 8)
    # The dashboard's explain view reads the K bounds and the controller flat off the decision.
    shown = d.as_dict()
    assert (shown["k_min"], shown["k_max"], shown["controller"]) == (0, 8, "goodput")


@pytest.mark.parametrize("label", ["math_reasoning", "qa", "translation"])
def test_short_k_where_speculation_is_near_break_even(label: str) -> None:
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx(label), explore=False)
    assert d.arm.method == "ngram" and (d.spec.k_min, d.spec.k_max) == (0, 3)


def test_high_temperature_open_chat_does_not_speculate() -> None:
    assert decide(ctx("open_chat", temperature=0.2)) == "embedded:ngram"
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx("open_chat", temperature=1.0), explore=False)
    assert (
        d.arm.key == "embedded:off" and (d.spec.k_min, d.spec.k_max) == (0, 0) and "temperature" in d.reason
    )


def test_large_batch_turns_speculation_off() -> None:
    assert decide(ctx("code", load=Load(LoadSnapshot(num_running=12, num_waiting=4)))) == "embedded:off"
    assert decide(ctx("code", load=Load(LoadSnapshot(num_running=12, num_waiting=3)))) == "embedded:ngram"
    assert (
        decide(ctx("code", load=Load(LoadSnapshot(num_running=100))), RuleConfig(max_batch_for_spec=0))
        == "embedded:ngram"
    )


def test_structured_output_never_takes_an_unsafe_method() -> None:
    rules = RuleConfig.from_dict({"classes": {"tool_call": {"method": "draft_model"}}})
    arms = [*EMBEDDED, Arm("embedded", "draft_model")]
    assert decide(ctx("tool_call", arms=arms, tools=True), rules) == "embedded:off"
    # Exploration never reaches the unsafe arm either (it always explores here: away from ngram).
    policy = RulePolicy(RuleConfig(exploration_rate=1.0, exploration_cap=1.0), seed=0)
    picks = {policy.decide(ctx("tool_call", arms=arms, tools=True)).arm.method for _ in range(200)}
    assert picks == {"off", "suffix"}


def test_low_confidence_uses_the_uncertain_rule() -> None:
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx("code", conf=0.3), explore=False)
    assert d.arm.method == "ngram" and d.spec.k_max == 3 and d.reason.startswith("uncertain")


def test_no_default_rule_forces_a_draft_every_step() -> None:
    """k_min 0 for every class and for `uncertain`: the engine's controller decides each step's K
    for the whole batch. A floor of 1 made that request draft in every pass, which under load slows
    the pass for all its batch mates."""
    rules = RuleConfig()
    assert all(rule.k_min == 0 for rule in [*rules.classes.values(), rules.uncertain])
    d = RulePolicy(rules, seed=0).decide(ctx("code", conf=0.3), explore=False)
    assert d.spec is not None and d.spec.k_min == 0


def test_external_backend_decides_its_own_speculation_and_unhealthy_ones_are_skipped() -> None:
    arms = [Arm("vllm", "upstream"), *EMBEDDED]
    assert decide(ctx("code", arms=arms)) == "vllm:upstream"
    sick = Load(backends={"vllm": BackendLoad(healthy=False)})
    assert decide(ctx("code", arms=arms, load=sick)) == "embedded:ngram"


def test_backend_order_is_kept_unless_routing_across_backends_is_on() -> None:
    arms = [Arm("vllm", "upstream"), *EMBEDDED]
    explorer = RulePolicy(
        RuleConfig(exploration_rate=1.0, exploration_cap=1.0, across_backends=False), seed=0
    )
    assert {explorer.decide(ctx("code", arms=arms)).arm.key for _ in range(50)} == {"vllm:upstream"}
    across = RulePolicy(RuleConfig(exploration_rate=0.5, exploration_cap=1.0, across_backends=True), seed=0)
    picks = {across.decide(ctx("code", arms=arms)).arm.backend for _ in range(50)}
    assert picks == {"vllm", "embedded"}


def test_rule_exploration_respects_rate_and_cap() -> None:
    rules = RuleConfig(exploration_rate=0.1, exploration_cap=0.1)
    budget = ExplorationBudget(rules.exploration_cap, window=100)
    policy = RulePolicy(rules, budget=budget, seed=3)
    explored = sum(policy.decide(ctx("code")).explored for _ in range(2000))
    assert 100 <= explored <= 220
    tight = RulePolicy(
        RuleConfig(exploration_rate=0.5, exploration_cap=0.5), budget=ExplorationBudget(0.02), seed=3
    )
    assert sum(tight.decide(ctx("code")).explored for _ in range(1000)) <= 21


def test_acceptance_prior_follows_class_and_method() -> None:
    policy = RulePolicy(RuleConfig(), priors={"code:ngram": 0.81}, seed=0)
    assert policy.decide(ctx("code"), explore=False).spec.acceptance_prior == 0.81
    assert policy.decide(ctx("rag"), explore=False).spec.acceptance_prior == SpecParams().acceptance_prior


@pytest.mark.parametrize(
    "patch",
    [
        {"exploration_rate": 0.5, "exploration_cap": 0.1},
        {"classes": {"poetry": {"method": "off"}}},
        {"classes": {"code": {"k_min": 5, "k_max": 2}}},
        {"min_confidence": 2.0},
    ],
)
def test_invalid_rules_are_refused(patch: dict) -> None:
    with pytest.raises(ValueError):
        RuleConfig().merged(patch)


def test_merge_keeps_unpatched_fields() -> None:
    rules = RuleConfig().merged({"classes": {"code": {"k_max": 4}}, "high_temperature": 0.7})
    assert rules.classes["code"].method == "ngram" and rules.classes["code"].k_max == 4
    assert rules.high_temperature == 0.7 and rules.classes["rag"].k_max == 8


def test_measured_low_acceptance_at_high_temperature_keeps_speculation_off() -> None:
    cost = steep()
    assert cost.best_k(1, 0.12, 4) == 0 and cost.best_k(1, 0.7, 4) > 0
    priors = {"open_chat:ngram": 0.7, "open_chat:ngram@t0.9+": 0.12}
    policy = RulePolicy(RuleConfig(), priors, seed=0, cost=cost)
    d = policy.decide(ctx("open_chat", temperature=1.0, arms=list(PLAIN_AND_NGRAM)), explore=False)
    assert d.arm.key == "embedded:off" and d.spec.method == "off" and d.spec.k_max == 0
    assert "temperature 1 (band >0.9): measured acceptance 0.12 pays no K at batch 1: off" in d.reason
    # The measurement decided, not the threshold; and it is no load turn-off for the dashboard.
    assert "nothing measured" not in d.reason and LOAD_OFF not in d.reason, d.reason
    # Greedy, the class's pooled acceptance pays.
    greedy = policy.decide(ctx("open_chat", arms=list(PLAIN_AND_NGRAM)), explore=False)
    assert greedy.arm.key == "embedded:ngram" and greedy.spec.acceptance_prior == 0.7


@pytest.mark.parametrize("label", ["qa", "code", "math_reasoning"])
def test_every_class_drops_speculation_its_band_measures_as_not_paying(label: str) -> None:
    # Below `high_temperature`, for classes the threshold never touched.
    priors = {f"{label}:ngram": 0.7, f"{label}:ngram@t0.5-0.9": 0.1}
    policy = RulePolicy(RuleConfig(), priors, seed=0, cost=steep())
    d = policy.decide(ctx(label, temperature=0.7, arms=list(PLAIN_AND_NGRAM)), explore=False)
    assert d.arm.key == "embedded:off"
    assert "temperature 0.7 (band (0.5, 0.9]): measured acceptance 0.10 pays no K at batch 1: off" in d.reason
    for t in (0.0, 0.3, 1.0):  # other bands: not measured, the pooled prior pays
        assert policy.decide(ctx(label, temperature=t), explore=False).arm.key == "embedded:ngram"
    # Another method, not measured there, stays: only ngram's acceptance is low.
    arms, why = safe_arms(ctx(label, temperature=0.7), RuleConfig(), steep(), priors)
    assert [a.method for a in arms] == ["off", "suffix"] and why == [
        "temperature 0.7 (band (0.5, 0.9]): measured acceptance 0.10 pays no K at batch 1: "
        "embedded:ngram dropped"
    ]


def test_measured_high_acceptance_speculates_above_the_threshold() -> None:
    cost = steep()
    priors = {"open_chat:ngram": 0.3, "open_chat:ngram@t0.9+": 0.8}
    policy = RulePolicy(RuleConfig(), priors, seed=0, cost=cost)
    d = policy.decide(ctx("open_chat", temperature=1.0), explore=False)
    assert d.arm.key == "embedded:ngram", d.reason
    assert "temperature 1 (band >0.9): measured acceptance 0.80 pays K 3 at batch 1: on" in d.reason
    assert (d.spec.k_min, d.spec.k_max) == (0, cost.best_k(1, 0.8, 4)) == (0, 3)
    assert d.spec.acceptance_prior == 0.8  # the band's, not the class's pooled 0.3
    # Past the threshold, a raised one included: still the measurement.
    hotter = RulePolicy(RuleConfig(high_temperature=0.5), priors, seed=0, cost=cost)
    assert hotter.decide(ctx("open_chat", temperature=1.3), explore=False).arm.key == "embedded:ngram"


def test_a_band_that_pays_alone_but_not_at_this_batch_is_a_load_turn_off() -> None:
    # 0.5 pays one draft at batch 1 and nothing from batch 2: the batch decided, and the reason
    # carries the dashboard's load mark.
    priors = {"open_chat:ngram@t0.9+": 0.5}
    policy = RulePolicy(RuleConfig(), priors, seed=0, cost=steep())
    idle = ctx("open_chat", temperature=1.0, arms=list(PLAIN_AND_NGRAM))
    assert policy.decide(idle, explore=False).arm.key == "embedded:ngram"
    busy = ctx(
        "open_chat", temperature=1.0, load=Load(LoadSnapshot(num_running=1)), arms=list(PLAIN_AND_NGRAM)
    )
    d = policy.decide(busy, explore=False)
    assert d.arm.key == "embedded:off" and "batch 1 past the measured crossover: speculation off" in d.reason


def test_cold_start_keeps_the_threshold() -> None:
    hot = ctx("open_chat", temperature=1.0)
    reason = "temperature 1 >= 0.9, nothing measured at this temperature: off"
    # A fresh install: no priors, no step cost.
    d = RulePolicy(RuleConfig(), seed=0).decide(hot, explore=False)
    assert d.arm.key == "embedded:off" and reason in d.reason
    # A pooled prior that pays, or another band measured, is no measurement at this temperature.
    for priors in ({"open_chat:ngram": 0.9}, {"open_chat:ngram@t0.5-0.9": 0.9, "open_chat:ngram@t0": 0.9}):
        d = RulePolicy(RuleConfig(), priors, seed=0, cost=steep()).decide(hot, explore=False)
        assert d.arm.key == "embedded:off" and reason in d.reason, d.reason
    # The band measured, but no step cost to weigh it: the threshold still.
    d = RulePolicy(RuleConfig(), {"open_chat:ngram@t0.9+": 0.9}, seed=0).decide(hot, explore=False)
    assert d.arm.key == "embedded:off"
    assert "temperature 1 >= 0.9, measured acceptance 0.90 but no step cost to weigh it: off" in d.reason
    # Below the threshold the rule's arm, as before.
    assert decide(ctx("open_chat", temperature=0.85)) == "embedded:ngram"
    # An external pool's step cost is never measured: the threshold holds there.
    pools = [Arm("vllm", "upstream-ngram"), Arm("vllm2", "upstream")]
    policy = RulePolicy(RuleConfig(), {"open_chat:ngram@t0.9+": 0.9}, seed=0, cost=steep())
    d = policy.decide(ctx("open_chat", temperature=1.0, arms=pools), explore=False)
    assert d.arm.key == "vllm2:upstream" and "external pool" in d.reason


def test_a_version_stored_before_the_bands_decides_as_it_did() -> None:
    stored = json.loads(json.dumps({"rules": RuleConfig().as_dict(), "priors": {"open_chat:ngram": 0.9}}))
    policy = PolicyState.from_dict(stored).build(seed=0)
    hot = policy.decide(ctx("open_chat", temperature=1.0), explore=False)
    assert hot.arm.key == "embedded:off" and "nothing measured at this temperature" in hot.reason
    warm = policy.decide(ctx("open_chat", temperature=0.5), explore=False)
    assert warm.arm.key == "embedded:ngram" and warm.spec.acceptance_prior == 0.9
