"""Off-policy evaluation: what a candidate policy's goodput would have been on traffic another
policy routed, from the logged propensities, with confidence intervals.

Each logged request carries the arm it took, the goodput it got (tokens/s) and the probability the
logging policy had of taking that arm (`propensity`, exploration and Thompson sampling included).
A target policy is evaluated greedily (no exploration), so it takes one arm per request:

- IPS (inverse propensity scoring): mean of 1[target arm = logged arm] * reward / propensity.
  Unbiased whenever every arm the target takes had a positive logging propensity; high variance.
- SNIPS: the same, normalized by the sum of the weights (biased, far less variance).
- DR (doubly robust; Dudik, Langford, Li 2011): a reward model's prediction for the target's arm,
  corrected on the matching requests by the weighted residual. Unbiased if either the propensities
  or the reward model is right; the variance of IPS shrinks by as much as the model explains.

Intervals are normal approximations over the per-request terms (95%: 1.96 standard errors). Two
policies are compared on the same requests by the per-request difference of their DR terms, so
what both get right cancels: `compare` gives the difference and its interval, and a candidate
should replace the active policy only when the interval's lower bound is above zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specgate.policies.decision import Policy
from specgate.policies.goodput import GoodputModel, TrainingRow, vector
from specgate.policies.training.evaluation import row_context

Z95 = 1.959964
RewardModel = Callable[[TrainingRow, str], float]  # predicted tokens/s of an arm for a logged request


@dataclass(slots=True)
class Estimate:
    value: float
    low: float
    high: float
    n: int  # logged requests with a propensity
    matched: int  # of which the target took the logged arm

    def as_dict(self) -> dict[str, Any]:
        return {
            "value": round(self.value, 4),
            "low": round(self.low, 4),
            "high": round(self.high, 4),
            "rows": self.n,
            "matched": self.matched,
        }


def interval(terms: Sequence[float], matched: int) -> Estimate:
    n = len(terms)
    if n == 0:
        raise ValueError("no logged request carries a propensity")
    mean = sum(terms) / n
    var = sum((t - mean) ** 2 for t in terms) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return Estimate(mean, mean - half, mean + half, n, matched)


def reward_model(model: GoodputModel | None, rows: Sequence[TrainingRow]) -> RewardModel:
    """Predicted tokens/s: the goodput model's where it models the arm, else the arm's mean reward
    in `rows` (the training split), else the mean of all of them."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        sums.setdefault(r.arm, []).append(r.tokens_per_s)
    means = {a: sum(v) / len(v) for a, v in sums.items()}
    overall = sum(r.tokens_per_s for r in rows) / len(rows) if rows else 0.0

    def predict(row: TrainingRow, arm: str) -> float:
        if model is not None and arm in model.arms:
            return math.exp(model.arms[arm].predict_log(vector(row.features, arm))[0])
        return means.get(arm, overall)

    return predict


@dataclass(slots=True)
class Terms:
    """Per logged request (those with a propensity): the IPS weight and reward, and the DR term."""

    weights: list[float]
    rewards: list[float]
    dr: list[float]

    @property
    def matched(self) -> int:
        return sum(w > 0 for w in self.weights)


def terms(
    policy: Policy, rows: Sequence[TrainingRow], arm_keys: Sequence[str], predict: RewardModel
) -> Terms:
    out = Terms([], [], [])
    for row in rows:
        if row.propensity is None:
            continue
        target = policy.decide(row_context(row, arm_keys), explore=False).arm.key
        w = (target == row.arm) / row.propensity
        out.weights.append(w)
        out.rewards.append(row.tokens_per_s)
        out.dr.append(predict(row, target) + w * (row.tokens_per_s - predict(row, row.arm)))
    return out


def ips(t: Terms) -> Estimate:
    return interval([w * r for w, r in zip(t.weights, t.rewards, strict=True)], t.matched)


def snips(t: Terms) -> float | None:
    total = sum(t.weights)
    return sum(w * r for w, r in zip(t.weights, t.rewards, strict=True)) / total if total > 0 else None


def doubly_robust(t: Terms) -> Estimate:
    return interval(t.dr, t.matched)


def evaluate(t: Terms) -> dict[str, Any]:
    """Every estimator for one policy, as the retrain report shows them."""
    out: dict[str, Any] = {"ips": ips(t).as_dict(), "dr": doubly_robust(t).as_dict()}
    value = snips(t)
    out["snips"] = None if value is None else round(value, 4)
    return out


def compare(candidate: Terms, current: Terms) -> Estimate:
    """DR goodput of the candidate minus the current policy's, request by request, with its interval."""
    if len(candidate.dr) != len(current.dr):
        raise ValueError("both policies must be evaluated on the same requests")
    diffs = [a - b for a, b in zip(candidate.dr, current.dr, strict=True)]
    return interval(diffs, candidate.matched)
