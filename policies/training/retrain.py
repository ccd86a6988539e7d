"""Retraining: fit a candidate policy on older telemetry, evaluate it against the current one on the
newest rows, and say whether it should be promoted.

Where the held-out rows carry logged propensities, the decision is off-policy (off_policy.py): the
candidate is promoted only when the 95% interval of its doubly robust goodput minus the current
policy's lies above zero. Older telemetry without propensities falls back to replay."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specgate.engine.step_cost import StepCost
from specgate.policies.crossover import pool_crossovers
from specgate.policies.decision import Policy
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel, TrainingRow
from specgate.policies.priors import acceptance_priors
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState
from specgate.policies.training.evaluation import ReplayResult, prediction_error, replay
from specgate.policies.training.off_policy import Estimate, compare, evaluate, reward_model, terms


class InsufficientData(ValueError):
    """Too little telemetry to fit or to evaluate a policy; the message says what is missing."""


@dataclass(slots=True)
class RetrainResult:
    state: PolicyState  # the candidate, refitted on every row
    n_rows: int
    n_train: int
    n_holdout: int
    window: tuple[float, float]  # arrival_time of the first and last row used
    arm_rows: dict[str, int]
    candidate: ReplayResult
    current: ReplayResult
    promote: bool
    reason: str
    # Off-policy estimates on the held-out rows with propensities (None: too few of them).
    off_policy: dict[str, Any] | None = None

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
            "off_policy": self.off_policy,
        }


def _greedy(state: PolicyState) -> Policy:
    return state.build(ExplorationBudget(0.0), seed=0)


def _evaluate(state: PolicyState, rows: Sequence[TrainingRow], arm_keys: list[str]) -> ReplayResult:
    result = replay(_greedy(state), rows, arm_keys)
    if state.model is not None:
        result.rmse_log = prediction_error(state.model, rows)
    return result


def retrain(
    rows: Sequence[TrainingRow],
    rules: RuleConfig,
    current: PolicyState,
    holdout_share: float = 0.2,
    force: bool = False,
    steps: Sequence[tuple[int, float]] = (),
) -> RetrainResult:
    """`steps`: measured (batch tokens, step ms) of engine steps in the window, for the step cost
    curve that bounds speculation by batch size (the current curve stays if they are too few)."""
    rows = sorted(rows, key=lambda r: r.arrival_time)
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
    cost = StepCost.fit(steps) or current.step_cost
    candidate = PolicyState(
        rules,
        GoodputModel.fit(train, rules.min_arm_rows),
        acceptance_priors(train),
        cost,
        pool_crossovers(train),
    )
    current = PolicyState(rules, current.model, current.priors, current.step_cost, current.crossovers)
    cand = _evaluate(candidate, holdout, arm_keys)
    cur = _evaluate(current, holdout, arm_keys)
    need = max(5, int(0.05 * len(holdout)))
    # Off-policy: the reward model is the candidate's, fitted on the training split only.
    predict = reward_model(candidate.model, train)
    cand_terms = terms(_greedy(candidate), holdout, arm_keys, predict)
    cur_terms = terms(_greedy(current), holdout, arm_keys, predict)
    off: dict[str, Any] | None = None
    diff: Estimate | None = None
    dr = (0.0, 0.0)  # the candidate's and the current policy's DR goodput
    if len(cand_terms.dr) >= need:
        diff = compare(cand_terms, cur_terms)
        off = {
            "candidate": evaluate(cand_terms),
            "current": evaluate(cur_terms),
            "difference": diff.as_dict(),
        }
        dr = (off["candidate"]["dr"]["value"], off["current"]["dr"]["value"])
    if force:
        promote, reason = True, "forced by the operator"
    elif diff is not None:
        promote, reason = diff.low > 0, _off_policy_reason(*dr, diff)
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
    final = PolicyState(
        rules,
        GoodputModel.fit(rows, rules.min_arm_rows),
        acceptance_priors(rows),
        cost,
        pool_crossovers(rows),
    )
    return RetrainResult(
        final,
        len(rows),
        len(train),
        len(holdout),
        (rows[0].arrival_time, rows[-1].arrival_time),
        dict(counts),
        cand,
        cur,
        promote,
        reason,
        off,
    )


def _off_policy_reason(a: float, b: float, diff: Estimate) -> str:
    """`a`, `b`: the candidate's and the current policy's DR goodput."""
    verdict = "above zero: promote" if diff.low > 0 else "not above zero: keep the current policy"
    return (
        f"doubly robust goodput {a:.2f} vs current {b:.2f} tok/s on {diff.n} held-out requests; "
        f"difference {diff.value:+.2f} (95% CI {diff.low:+.2f} to {diff.high:+.2f}), {verdict}"
    )
