"""Retraining: fit a candidate policy on older telemetry, evaluate it against the current one on the
newest rows, and say whether it should be promoted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specgate.policies.evaluation import ReplayResult, prediction_error, replay
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel, TrainingRow
from specgate.policies.priors import acceptance_priors
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState


class InsufficientData(ValueError):
    """Too little telemetry to fit or to evaluate a policy; the message says what is missing."""


@dataclass(slots=True)
class RetrainResult:
    state: PolicyState  # the candidate, refitted on every row
    n_rows: int
    n_train: int
    n_holdout: int
    window: tuple[float, float]  # received_at of the first and last row used
    arm_rows: dict[str, int]
    candidate: ReplayResult
    current: ReplayResult
    promote: bool
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.n_rows,
            "train_rows": self.n_train,
            "holdout_rows": self.n_holdout,
            "window": list(self.window),
            "arm_rows": self.arm_rows,
            "modelled_arms": sorted(self.state.model.arms) if self.state.model else [],
            "candidate": self.candidate.as_dict(),
            "current": self.current.as_dict(),
            "promote": self.promote,
            "reason": self.reason,
        }


def _evaluate(state: PolicyState, rows: Sequence[TrainingRow], arm_keys: list[str]) -> ReplayResult:
    policy = state.build(ExplorationBudget(0.0), seed=0)
    result = replay(policy, rows, arm_keys)
    if state.model is not None:
        result.rmse_log = prediction_error(state.model, rows)
    return result


def retrain(
    rows: Sequence[TrainingRow],
    rules: RuleConfig,
    current: PolicyState,
    holdout_share: float = 0.2,
    force: bool = False,
) -> RetrainResult:
    rows = sorted(rows, key=lambda r: r.received_at)
    if len(rows) < rules.min_train_rows:
        raise InsufficientData(
            f"retraining needs at least {rules.min_train_rows} finished requests with measured goodput "
            f"in the window; found {len(rows)}"
        )
    counts = Counter(r.arm for r in rows)
    cut = int(len(rows) * (1.0 - holdout_share))
    train, holdout = rows[:cut], rows[cut:]
    trainable = {a for a, n in Counter(r.arm for r in train).items() if n >= rules.min_arm_rows}
    if len(trainable) < 2:
        have = ", ".join(f"{a}={n}" for a, n in counts.most_common()) or "none"
        raise InsufficientData(
            f"retraining needs at least two arms with {rules.min_arm_rows}+ training rows each, so that "
            f"there is a choice to learn; rows per arm: {have}"
        )
    arm_keys = sorted(counts)
    candidate = PolicyState(rules, GoodputModel.fit(train, rules.min_arm_rows), acceptance_priors(train))
    cand = _evaluate(candidate, holdout, arm_keys)
    cur = _evaluate(PolicyState(rules, current.model, current.priors), holdout, arm_keys)
    need = max(5, int(0.05 * len(holdout)))
    if force:
        promote, reason = True, "forced by the operator"
    elif cand.matched < need:
        promote, reason = (
            False,
            f"candidate matches only {cand.matched} held-out requests (< {need}): not evaluable",
        )
    elif cur.value is None or cur.matched < need:
        promote, reason = (
            True,
            f"current policy matches only {cur.matched} held-out requests; candidate does {cand.matched}",
        )
    elif cand.value is not None and cand.value > cur.value:
        promote, reason = True, f"replay goodput {cand.value:.2f} > current {cur.value:.2f} tok/s"
    else:
        promote, reason = False, f"replay goodput {cand.value or 0:.2f} <= current {cur.value:.2f} tok/s"
    final = PolicyState(rules, GoodputModel.fit(rows, rules.min_arm_rows), acceptance_priors(rows))
    return RetrainResult(
        final,
        len(rows),
        len(train),
        len(holdout),
        (rows[0].received_at, rows[-1].received_at),
        dict(counts),
        cand,
        cur,
        promote,
        reason,
    )
