"""Acceptance priors per workload class, speculation method and temperature band, from measured
telemetry: the engine's dynamic-K controller starts each request from one, and the guards weigh it
against the measured step cost to say whether any draft length pays.

Acceptance (accepted / drafted tokens) depends on the temperature as much as on the class:
speculation is lossless at any temperature (rejection sampling keeps the target's distribution),
but the chance that a draft survives verification falls as sampling flattens the target's
distribution. Greedy, a draft is accepted when it is the argmax; sampled, with the probability
sum(min(p, q)) over the vocabulary (for a deterministic draft, the target's probability of the
drafted token). So each class and method is measured per band of temperature:

- `t0`, t = 0 (below 1e-5, where the engine samples greedily): exact matches of the argmax, the
  highest acceptance a drafter reaches;
- `t0-0.5`, (0, 0.5]: low-temperature sampling (0.1-0.3 for code and extraction), a peaked
  distribution whose acceptance stays near greedy;
- `t0.5-0.9`, (0.5, 0.9]: 0.7, the most common chat setting of clients and apps;
- `t0.9+`, above 0.9: 1.0, the OpenAI default and so every request that sets no temperature, and
  anything hotter: the unscaled distribution, the lowest acceptance.

The two settings most real chat uses, 0.7 and 1.0, fall in different bands, split where the rules'
`high_temperature` threshold sits by default; more bands would spread the rows that exploration
gathers thinner than they are worth.

Each level is shrunk toward the next with `PSEUDO_TOKENS` drafted tokens' worth of weight: a
class's pooled measurement (all temperatures) toward the engine's default, a band's toward its
class's pooled prior. A band with fewer than `BAND_MIN_TOKENS` drafted tokens is not stored: a
request or two does not stand for a temperature. Lookup falls back from the band to the pooled
prior to the default, and says which level answered: only a band's own measurement replaces the
rules' fixed `high_temperature` threshold (rule_policy.py).

Stored form (a policy version's `priors`, JSON): `{"<class>:<method>": p}` is the pooled prior,
as versions stored before the bands wrote it, and `{"<class>:<method>@<band>": p}` a band's, so an
older version loads as it is and means what it meant: no band measured, every temperature gets the
pooled prior, and the threshold decides at high temperature.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from specgate.policies.arms import Arm
from specgate.policies.goodput import TrainingRow

DEFAULT_PRIOR = 0.6  # the engine's own default
PSEUDO_TOKENS = 64  # drafted tokens' worth of weight on the next level
BAND_MIN_TOKENS = 4 * PSEUDO_TOKENS  # drafted tokens a band needs before it is stored
GREEDY_BELOW = 1e-5  # the engine samples greedily below this temperature

Source = Literal["band", "class", "default"]


@dataclass(slots=True, frozen=True)
class Band:
    key: str  # in the stored key, after "@"
    label: str  # as a decision's reason says it
    upper: float  # the highest temperature in the band (inclusive)


BANDS = (
    Band("t0", "t=0", 0.0),
    Band("t0-0.5", "(0, 0.5]", 0.5),
    Band("t0.5-0.9", "(0.5, 0.9]", 0.9),
    Band("t0.9+", ">0.9", math.inf),
)


def band_of(temperature: float) -> Band:
    if temperature < GREEDY_BELOW:
        return BANDS[0]
    return next((b for b in BANDS[1:] if temperature <= b.upper), BANDS[-1])


def prior_key(label: str, method: str, band: Band | None = None) -> str:
    key = f"{label}:{method}"
    return key if band is None else f"{key}@{band.key}"


@dataclass(slots=True, frozen=True)
class Prior:
    """A request's acceptance prior and where it came from: its own band's measurement, its class's
    pooled over all temperatures, or the engine's default (nothing measured)."""

    value: float
    band: Band
    source: Source

    @property
    def measured(self) -> bool:
        """Whether telemetry measured this class and method at this request's temperature."""
        return self.source == "band"


def lookup(priors: Mapping[str, float], label: str, method: str, temperature: float) -> Prior:
    band = band_of(temperature)
    banded = priors.get(prior_key(label, method, band))
    if banded is not None:
        return Prior(float(banded), band, "band")
    pooled = priors.get(prior_key(label, method))
    if pooled is not None:
        return Prior(float(pooled), band, "class")
    return Prior(DEFAULT_PRIOR, band, "default")


def _shrunk(accepted: int, drafted: int, toward: float) -> float:
    return (accepted + PSEUDO_TOKENS * toward) / (drafted + PSEUDO_TOKENS)


def acceptance_priors(rows: Iterable[TrainingRow]) -> dict[str, float]:
    """The pooled prior of every class and method with drafted tokens, and the prior of each of its
    temperature bands with at least `BAND_MIN_TOKENS` drafted tokens; keys sorted."""
    pooled: dict[str, list[int]] = {}  # key -> [drafted, accepted]
    banded: dict[tuple[str, Band], list[int]] = {}
    for r in rows:
        if not r.label or not r.draft_tokens:
            continue
        key = prior_key(r.label, Arm.parse(r.arm).method)
        accepted = r.accepted_tokens or 0
        counts = pooled.setdefault(key, [0, 0])
        counts[0] += r.draft_tokens
        counts[1] += accepted
        temperature = r.features.get("temperature")
        # A row that did not record its temperature counts toward its class's pooled prior only.
        if temperature is not None and math.isfinite(temperature) and temperature >= 0:
            counts = banded.setdefault((key, band_of(temperature)), [0, 0])
            counts[0] += r.draft_tokens
            counts[1] += accepted
    level = {key: _shrunk(accepted, drafted, DEFAULT_PRIOR) for key, (drafted, accepted) in pooled.items()}
    out = {key: round(p, 4) for key, p in level.items()}
    for (key, band), (drafted, accepted) in banded.items():
        if drafted >= BAND_MIN_TOKENS:
            out[f"{key}@{band.key}"] = round(_shrunk(accepted, drafted, level[key]), 4)
    return {key: out[key] for key in sorted(out)}
