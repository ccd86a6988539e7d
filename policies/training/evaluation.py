"""Offline evaluation of a policy on held-out telemetry, by replay.

Replay (Li et al., WSDM 2011): walk the held-out requests in order, ask the policy which arm it
would take (greedily), and where that is the arm the request actually took, count its measured
goodput. The policy's value is the mean over those matches. It is unbiased when the logged arms
were chosen at random and still informative when exploration supplied the off-policy arms;
`coverage` says how much of the held-out traffic the estimate rests on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specgate.policies.arms import Arm
from specgate.policies.classes import WORKLOAD_CLASSES
from specgate.policies.decision import DecisionContext, Policy
from specgate.policies.goodput import GoodputModel, TrainingRow, vector
from specgate.policies.load import Load


@dataclass(slots=True)
class ReplayResult:
    n_rows: int
    matched: int
    value: float | None  # mean measured tokens/s over matched requests
    rmse_log: float | None = None  # learned models: error of predicted log tokens/s on logged arms

    @property
    def coverage(self) -> float:
        return self.matched / self.n_rows if self.n_rows else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.n_rows,
            "matched": self.matched,
            "coverage": round(self.coverage, 4),
            "value_tokens_per_s": None if self.value is None else round(self.value, 3),
            "rmse_log_tokens_per_s": None if self.rmse_log is None else round(self.rmse_log, 4),
        }


def row_context(row: TrainingRow, arm_keys: Sequence[str]) -> DecisionContext:
    probs = {c: row.features.get(f"p_{c}", 0.0) for c in WORKLOAD_CLASSES}
    label = row.label or max(probs, key=probs.__getitem__)
    logged = Arm.parse(row.arm)
    others = [Arm.parse(k) for k in arm_keys if k != row.arm]
    arms = [logged, *sorted((a for a in others if a.backend == logged.backend), key=lambda a: a.method)]
    arms += [a for a in others if a.backend != logged.backend]
    return DecisionContext(
        label, max(probs.values()) or 1.0, row.features, Load.from_features(row.features), arms
    )


def replay(policy: Policy, rows: Sequence[TrainingRow], arm_keys: Sequence[str]) -> ReplayResult:
    hits: list[float] = []
    for row in rows:
        decision = policy.decide(row_context(row, arm_keys), explore=False)
        if decision.arm.key == row.arm:
            hits.append(row.tokens_per_s)
    return ReplayResult(len(rows), len(hits), sum(hits) / len(hits) if hits else None)


def prediction_error(model: GoodputModel, rows: Sequence[TrainingRow]) -> float | None:
    errs = [
        (model.arms[r.arm].predict_log(vector(r.features, r.arm))[0] - math.log(r.tokens_per_s)) ** 2
        for r in rows
        if r.arm in model.arms
    ]
    return math.sqrt(sum(errs) / len(errs)) if errs else None
