"""The learned policy: the arm with the best predicted goodput, chosen by Thompson sampling over the
per-arm posteriors, within the guards and the exploration cap. It leaves the rules' arm only for an
arm that leads it by `deviation_z` standard errors, and falls back to the rules where no arm is
modelled. The guards and the K it hands the engine read the acceptance measured for the request's
class, method and temperature band (priors.py), as the rules' do."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import numpy as np

from specgate.engine.step_cost import StepCost
from specgate.policies.arms import Arm
from specgate.policies.decision import Decision, DecisionContext, Slo
from specgate.policies.exploration import ExplorationBudget
from specgate.policies.goodput import GoodputModel, Prediction
from specgate.policies.guards import safe_arms
from specgate.policies.rule_policy import RulePolicy
from specgate.policies.rules import RuleConfig


class LearnedPolicy:
    kind = "learned"

    def __init__(
        self,
        rules: RuleConfig,
        model: GoodputModel,
        priors: Mapping[str, float] | None = None,
        budget: ExplorationBudget | None = None,
        seed: int | None = None,
        cost: StepCost | None = None,
        crossovers: dict[str, float] | None = None,
    ) -> None:
        self.rules = rules
        self.model = model
        self.budget = budget or ExplorationBudget(rules.exploration_cap)
        self.fallback = RulePolicy(rules, priors, self.budget, seed, cost, crossovers)
        self.rng = random.Random(seed)

    def decide(self, ctx: DecisionContext, explore: bool = True) -> Decision:
        fb = self.fallback
        arms, why = safe_arms(ctx, self.rules, fb.cost, fb.priors, fb.crossovers)
        modelled = [a for a in arms if a.key in self.model.arms]
        if not modelled:
            decision = self.fallback.decide(ctx, explore)
            decision.reason = "no modelled arm: rules; " + decision.reason
            return decision
        preds = {a: self.model.predict(a.key, ctx.model_input(a)) for a in modelled}
        slo_miss = False
        headroom: dict[Arm, float] = {}
        if ctx.slo is not None:
            modelled, arms, slo_miss, headroom = self._within_slo(ctx.slo, arms, modelled, preds, why)
        greedy = self._greedy(ctx, arms, modelled, preds, why)
        pick, explored = greedy, False
        shares = {greedy: 1.0}  # the probability of each arm this decision could have taken
        if explore:
            allowed = self.budget.allows()  # a pure check: the same answer for both branches below
            unmodelled = [a for a in arms if a.key not in self.model.arms]
            scale = self.rules.thompson_scale
            sampling = scale > 0 and len(modelled) > 1
            if sampling:
                ts = thompson_shares(
                    [preds[a].log_mean for a in modelled], [preds[a].log_std for a in modelled], scale
                )
                # A sample other than the greedy arm is taken only within the budget.
                shares = {a: float(p) * allowed for a, p in zip(modelled, ts, strict=True)}
                shares[greedy] = 1.0 - sum(p for a, p in shares.items() if a != greedy)
            if unmodelled and allowed:
                rate = self.rules.exploration_rate
                shares = {a: p * (1.0 - rate) for a, p in shares.items()}
                shares.update({a: rate / len(unmodelled) for a in unmodelled})
            if unmodelled and self.rng.random() < self.rules.exploration_rate and allowed:
                pick = self.rng.choice(unmodelled)
                why.append(f"exploring {pick.key} (no model yet)")
            elif sampling:
                sampled = max(
                    modelled,
                    key=lambda a: preds[a].log_mean + scale * preds[a].log_std * self.rng.gauss(0.0, 1.0),
                )
                if sampled != greedy and allowed:
                    pick = sampled
                    why.append(f"Thompson sample picked {pick.key} over {greedy.key}")
            explored = pick != greedy
            self.budget.note(explored)
        best = preds[greedy]
        why.insert(0, f"{ctx.label}: chose {greedy.key}, predicted {best.tokens_per_s:.1f} tok/s")
        decision = self.fallback.finish(ctx, pick, "; ".join(why), explored)
        decision.predictions = {a.key: p.as_dict() for a, p in preds.items()}
        # Thompson shares are estimated from a fixed set of draws: an arm that was in fact sampled
        # is never given less than one draw's worth.
        decision.propensity = min(1.0, max(shares.get(pick, 0.0), 1.0 / THOMPSON_DRAWS))
        decision.slo_headroom = headroom.get(pick)
        decision.slo_miss = slo_miss
        return decision

    @staticmethod
    def _within_slo(
        slo: Slo, arms: list[Arm], modelled: list[Arm], preds: dict[Arm, Prediction], why: list[str]
    ) -> tuple[list[Arm], list[Arm], bool, dict[Arm, float]]:
        """The arms the request may take under its latency targets: the modelled arms predicted to
        meet them (goodput then chooses among them as usual), or, if none is, the one with the
        most headroom (a miss). Arms whose TTFT or TPOT is not modelled cannot be judged: they are
        kept only when no modelled arm can be."""
        headroom = {
            a: h for a in modelled if (h := slo.headroom(preds[a].ttft_ms, preds[a].tpot_ms)) is not None
        }
        if not headroom:
            why.append("SLO: no arm's latency is modelled yet")
            return modelled, arms, False, headroom
        meeting = [a for a in modelled if headroom.get(a, 0.0) >= 1.0]
        if meeting:
            if len(meeting) < len(modelled):
                why.append(
                    "SLO: " + ", ".join(a.key for a in modelled if a not in meeting) + " predicted to miss"
                )
            return meeting, [a for a in arms if a in meeting], False, headroom
        best = max(headroom, key=lambda a: headroom[a])
        # Only an arm with no goodput model at all can still be taken (by exploration): one with a
        # goodput model but no latency model is neither judged nor choosable here.
        unjudged = [a for a in arms if a not in preds]
        why.append(
            f"SLO: no modelled arm predicted to meet it; {best.key} has the most headroom "
            f"({headroom[best]:.2f})"
        )
        # An arm whose latency is not modelled might meet it: not a miss while one is left.
        return [best], [best, *unjudged], not unjudged, headroom

    def _greedy(
        self,
        ctx: DecisionContext,
        arms: list[Arm],
        modelled: list[Arm],
        preds: dict[Arm, Prediction],
        why: list[str],
    ) -> Arm:
        """The arm with the best predicted goodput, unless the rules' arm is modelled too and the
        lead is within `deviation_z` standard errors: then the rules' (safe policy improvement:
        leave the baseline only where the data say so)."""
        best = max(modelled, key=lambda a: preds[a].log_mean)
        baseline = self.fallback.target(ctx, arms, [])
        if baseline == best or baseline not in modelled:
            return best
        lead = preds[best].log_mean - preds[baseline].log_mean
        error = math.hypot(preds[best].mean_std, preds[baseline].mean_std)
        if lead > self.rules.deviation_z * error:
            return best
        why.append(
            f"{best.key} leads the rules' {baseline.key} by {lead:+.2f} log tok/s, within "
            f"{self.rules.deviation_z:g} x {error:.2f}: keeping {baseline.key}"
        )
        return baseline


THOMPSON_DRAWS = 512
# Fixed standard normal draws [THOMPSON_DRAWS, arms]: the same request in the same policy state
# always gets the same propensity; columns are added as a decision has more arms.
_Z = np.random.default_rng(20261201).standard_normal((THOMPSON_DRAWS, 16))


def thompson_shares(log_means: list[float], log_stds: list[float], scale: float) -> np.ndarray:
    """How often each arm wins a Thompson draw (mean + scale * spread * z), estimated on fixed
    draws. Ties go to the first arm, as `max` does."""
    n = len(log_means)
    z = _Z[:, :n] if n <= _Z.shape[1] else np.random.default_rng(n).standard_normal((THOMPSON_DRAWS, n))
    samples = np.asarray(log_means) + scale * np.asarray(log_stds) * z  # [draws, arms]
    wins = np.bincount(samples.argmax(axis=1), minlength=n)  # [arms]
    shares: np.ndarray = wins / THOMPSON_DRAWS
    return shares
