"""Retraining measures acceptance per class, method and temperature band, and the version it makes
decides high-temperature speculation by it."""

from __future__ import annotations

from specgate.policies.arms import Arm
from specgate.policies.decision import DecisionContext
from specgate.policies.load import Load
from specgate.policies.priors import acceptance_priors
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.training.retrain import retrain
from tests.policies import synthetic_telemetry as synth


def test_retrain_measures_acceptance_per_temperature_band() -> None:
    rows = synth.rows(800, seed=7)
    for i, r in enumerate(rows):  # half of open chat sampled at t=1, where ngram's drafts fail
        if r.label == "open_chat" and i % 4 == 1:
            r.features["temperature"] = 1.0
            if r.draft_tokens:
                r.accepted_tokens = 3
    # 10 ms plus 5 ms per token: at batch 1, acceptance below 1/3 pays no draft.
    steps = [(n, 10.0 + 5.0 * n) for n in (1, 2, 4, 8, 16, 32, 64) for _ in range(10)]
    result = retrain(rows, RuleConfig(), PolicyState(), steps=steps)
    priors = result.state.priors
    assert priors == acceptance_priors(rows)  # the version keeps what every row measured
    assert set(priors) == {
        "code:ngram",
        "code:ngram@t0",
        "open_chat:ngram",
        "open_chat:ngram@t0",
        "open_chat:ngram@t0.9+",
    }
    assert priors["open_chat:ngram@t0.9+"] < 0.05 < priors["open_chat:ngram"] < priors["open_chat:ngram@t0"]
    assert priors["code:ngram@t0"] > 0.6

    policy = result.state.build(seed=0)
    arms = [Arm("embedded", "off"), Arm("embedded", "ngram")]
    # Code at t=1 was never measured: its pooled prior (greedy rows) pays, and the engine starts
    # from it. Open chat at t=1 was, and its acceptance pays no K.
    code = policy.decide(DecisionContext("code", 0.95, {"temperature": 1.0}, Load(), arms), False)
    assert code.arm.key == "embedded:ngram" and code.spec.acceptance_prior == priors["code:ngram"]
    chat = policy.decide(DecisionContext("open_chat", 0.95, {"temperature": 1.0}, Load(), arms), False)
    assert chat.arm.key == "embedded:off"
    assert "temperature 1 (band >0.9): measured acceptance 0.03 pays no K at batch 1: off" in chat.reason
