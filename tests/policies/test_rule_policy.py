"""The default rule policy: per-class arms, the published-evidence rules, guards and exploration."""

from __future__ import annotations

import pytest

from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.load import BackendLoad, Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig

EMBEDDED = [Arm("embedded", "off"), Arm("embedded", "ngram"), Arm("embedded", "suffix")]


def ctx(label: str, conf: float = 0.95, temperature: float = 0.0, load: Load | None = None,
        arms: list[Arm] | None = None, tools: bool = False) -> DecisionContext:  # fmt: skip
    feats = {"temperature": temperature, "tools_or_json": float(tools)}
    return DecisionContext(label, conf, feats, load or Load(), arms or list(EMBEDDED))


def decide(c: DecisionContext, rules: RuleConfig | None = None) -> str:
    return RulePolicy(rules or RuleConfig(), seed=0).decide(c, explore=False).arm.key


@pytest.mark.parametrize("label", ["code", "tool_call", "summarization", "rag"])
def test_speculates_where_the_evidence_says_it_pays(label: str) -> None:
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx(label), explore=False)
    assert d.arm.speculative and (d.k_min, d.k_max) == (1, 8)


@pytest.mark.parametrize("label", ["math_reasoning", "qa", "translation"])
def test_short_k_where_speculation_is_near_break_even(label: str) -> None:
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx(label), explore=False)
    assert d.arm.method == "ngram" and (d.k_min, d.k_max) == (1, 3)


def test_high_temperature_open_chat_does_not_speculate() -> None:
    assert decide(ctx("open_chat", temperature=0.2)) == "embedded:ngram"
    d = RulePolicy(RuleConfig(), seed=0).decide(ctx("open_chat", temperature=1.0), explore=False)
    assert d.arm.key == "embedded:off" and (d.k_min, d.k_max) == (0, 0) and "temperature" in d.reason


def test_large_batch_turns_speculation_off() -> None:
    assert decide(ctx("code", load=Load(running=12, queue_depth=4))) == "embedded:off"
    assert decide(ctx("code", load=Load(running=12, queue_depth=3))) == "embedded:ngram"
    assert decide(ctx("code", load=Load(running=100)), RuleConfig(max_batch_for_spec=0)) == "embedded:ngram"


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
    assert d.arm.method == "ngram" and d.k_max == 3 and d.reason.startswith("uncertain")


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
    assert policy.decide(ctx("code"), explore=False).acceptance_prior == 0.81
    assert policy.decide(ctx("rag"), explore=False).acceptance_prior is None


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
