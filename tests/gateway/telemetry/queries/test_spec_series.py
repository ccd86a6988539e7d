"""The Speculation page finds requests the policy kept plain for the load by the reason the
policies' guard records: the two stay in step (a rule policy deciding under a large batch leaves a
reason the series' LIKE pattern matches; an ordinary decision does not)."""

from __future__ import annotations

import re

from specgate.engine.vocab import LoadSnapshot
from specgate.gateway.telemetry.queries.spec_series import LOAD_OFF_MARK
from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.load import Load
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig


def like(pattern: str, text: str) -> bool:
    regex = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, text, re.DOTALL) is not None


def decide(running: int, waiting: int) -> str:
    arms = [Arm("embedded", "off"), Arm("embedded", "ngram")]
    ctx = DecisionContext(
        "code", 0.95, {"temperature": 0.0}, Load(LoadSnapshot(num_running=running, num_waiting=waiting)), arms
    )
    decision = RulePolicy(RuleConfig(max_batch_for_spec=4, exploration_rate=0.0)).decide(ctx, explore=False)
    return decision.reason if decision.arm.method == "off" else ""


def test_the_guard_reason_is_what_the_series_looks_for() -> None:
    reason = decide(running=3, waiting=1)
    assert reason and like(LOAD_OFF_MARK, reason)
    assert not like(LOAD_OFF_MARK, "code (0.95): rule ngram") and decide(running=1, waiting=1) == ""
