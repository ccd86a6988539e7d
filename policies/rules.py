"""The operator-tunable rule set: per-class arms, K bounds, load thresholds, exploration.

The defaults encode the published evidence (Spec-Bench prompt lookup: 2.66x on summarization,
1.86x on RAG, 1.62x on math, 1.60x on MT-bench, 1.19x on QA, 1.06x on translation; every method
loses under a large batch): speculate on code, tool calls, summarization and RAG; short K on
reasoning, QA and translation; off for high-temperature open chat until acceptance at that
temperature is measured; off when the batch is large.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specgate.engine.vocab import check_controller, check_k_range
from specgate.policies.arms import OFF, UPSTREAM
from specgate.policies.classes import WORKLOAD_CLASSES, check_class


@dataclass(slots=True)
class ClassRule:
    method: str = "ngram"  # a proposer or "off"
    k_min: int = 0
    k_max: int = 8
    controller: str = "goodput"

    def __post_init__(self) -> None:
        if not self.method or self.method == UPSTREAM:
            raise ValueError("method must be a proposer name or 'off'")
        check_k_range(self.k_min, self.k_max)
        check_controller(self.controller)

    @property
    def k_range(self) -> tuple[int, int]:
        """(k_min, k_max) a speculative arm gets: a rule of K 0 leaves the engine's own 0-4."""
        return (self.k_min, self.k_max) if self.k_max > 0 else (0, 4)


def default_class_rules() -> dict[str, ClassRule]:
    # k_min 0: the engine's goodput controller chooses each step's K for the whole batch, 0 where
    # no draft pays; a floor of 1 made every speculating request draft in every step, which under
    # load slowed each pass for all of them (16 in flight: 0.94x plain).
    return {
        "code": ClassRule("ngram", 0, 8),
        "tool_call": ClassRule("ngram", 0, 8),
        "summarization": ClassRule("ngram", 0, 8),
        "rag": ClassRule("ngram", 0, 8),
        "math_reasoning": ClassRule("ngram", 0, 3),
        "qa": ClassRule("ngram", 0, 3),
        # Near break-even in Spec-Bench (1.06x), 2.4x on this project's default model: short K.
        "translation": ClassRule("ngram", 0, 3),
        "open_chat": ClassRule("ngram", 0, 4),
    }


@dataclass(slots=True)
class RuleConfig:
    classes: dict[str, ClassRule] = field(default_factory=default_class_rules)
    # Below this classifier confidence a request is routed as `uncertain`, not by its class.
    min_confidence: float = 0.5
    # k_min 0 as for every class (default_class_rules): a floor of 1 made one unclassified request
    # add a row to every pass of a full batch (16 in flight: policy 0.93-0.96x plain).
    uncertain: ClassRule = field(default_factory=lambda: ClassRule("ngram", 0, 3))
    # The cold-start fallback for sampled open chat: at or above this temperature it does not
    # speculate while nothing measures its acceptance there. Once the request's class, method and
    # temperature band has measured acceptance (priors.py) and the step cost is measured, that
    # decides instead, for every class: speculation is lossless at any temperature, and whether it
    # pays is a matter of acceptance, not of a fixed number.
    high_temperature: float = 0.9
    # Speculation turns off once running + waiting embedded sequences reach this (0: never).
    max_batch_for_spec: int = 16
    # Methods allowed for tool calls / JSON output (the others are never chosen for them).
    structured_methods: list[str] = field(default_factory=lambda: ["ngram", "suffix"])
    # True: the policy chooses among every healthy backend's arms (a replica group is one), by
    # predicted goodput (learned) and exploration; the rules prefer the first healthy backend in
    # the configured order, or its speculative / plain pool as the class's rule says. False: only
    # the first healthy backend's arms (the order is the operator's preference and failover plan).
    across_backends: bool = True
    # Share of traffic routed to a random safe arm to learn about it; and the hard cap on the
    # share of decisions that explore, whichever policy is active.
    exploration_rate: float = 0.05
    exploration_cap: float = 0.1
    # Thompson sampling: multiplier on the learned model's posterior spread (0: greedy).
    thompson_scale: float = 1.0
    # The learned policy leaves the arm the rules would take only for an arm whose expected goodput
    # is higher by at least this many standard errors of the difference (0: whichever predicts
    # higher). Thin training data then keeps the rules' choice instead of a noisy model's.
    deviation_z: float = 1.0
    # Retraining: rows needed before a fit is tried, and per arm before an arm is modelled.
    min_train_rows: int = 200
    min_arm_rows: int = 20

    def __post_init__(self) -> None:
        for name in self.classes:
            check_class(name)
        missing = set(WORKLOAD_CLASSES) - set(self.classes)
        if missing:
            defaults = default_class_rules()
            for name in missing:
                self.classes[name] = defaults[name]
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError("min_confidence must be in [0, 1]")
        if self.high_temperature < 0:
            raise ValueError("high_temperature must be >= 0")
        if self.max_batch_for_spec < 0:
            raise ValueError("max_batch_for_spec must be >= 0")
        if not 0.0 <= self.exploration_rate <= 1.0 or not 0.0 <= self.exploration_cap <= 1.0:
            raise ValueError("exploration_rate and exploration_cap must be in [0, 1]")
        if self.exploration_rate > self.exploration_cap:
            raise ValueError("exploration_rate must not exceed exploration_cap")
        if self.thompson_scale < 0:
            raise ValueError("thompson_scale must be >= 0")
        if not 0.0 <= self.deviation_z <= 10.0:
            raise ValueError("deviation_z must be in [0, 10]")
        if self.min_train_rows < 10 or self.min_arm_rows < 5:
            raise ValueError("min_train_rows must be >= 10 and min_arm_rows >= 5")
        if OFF in self.structured_methods:
            raise ValueError("structured_methods lists proposers; 'off' is always allowed")

    def rule_for(self, label: str, confidence: float) -> ClassRule:
        return self.classes[label] if confidence >= self.min_confidence else self.uncertain

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RuleConfig:
        data = dict(data)
        if "classes" in data:
            data["classes"] = {k: ClassRule(**v) for k, v in data["classes"].items()}
        if "uncertain" in data:
            data["uncertain"] = ClassRule(**data["uncertain"])
        return cls(**data)

    def merged(self, patch: dict[str, Any]) -> RuleConfig:
        """A new config with `patch` applied; per-class rules merge field by field."""
        base = self.as_dict()
        for key, value in patch.items():
            if key == "classes" and isinstance(value, dict):
                for name, rule in value.items():
                    base["classes"][name] = {**base["classes"].get(name, {}), **rule}
            elif key == "uncertain" and isinstance(value, dict):
                base["uncertain"] = {**base["uncertain"], **value}
            else:
                base[key] = value
        return RuleConfig.from_dict(base)
