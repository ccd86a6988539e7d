"""Acceptance priors per class, method and temperature band (policies/priors.py): known counts give
known values, lookup falls back band -> class -> default, each level is shrunk toward the next, and
versions stored before the bands load and mean what they meant."""

from __future__ import annotations

import json

import pytest

from specgate.policies.goodput import TrainingRow
from specgate.policies.priors import (
    BAND_MIN_TOKENS,
    DEFAULT_PRIOR,
    PSEUDO_TOKENS,
    acceptance_priors,
    band_of,
    lookup,
)
from specgate.policies.rules import RuleConfig
from specgate.policies.state import PolicyState


def row(
    label: str | None, arm: str, temperature: float | None, drafted: int | None, accepted: int | None
) -> TrainingRow:
    features = {} if temperature is None else {"temperature": temperature}
    return TrainingRow(arm, features, 20.0, 50.0, label, 0.0, drafted, accepted)


@pytest.mark.parametrize(
    ("temperature", "band"),
    [
        (0.0, "t0"),
        (1e-6, "t0"),  # the engine samples greedily below 1e-5
        (0.2, "t0-0.5"),
        (0.5, "t0-0.5"),
        (0.7, "t0.5-0.9"),
        (0.9, "t0.5-0.9"),
        (0.91, "t0.9+"),
        (1.0, "t0.9+"),
        (2.0, "t0.9+"),
    ],
)
def test_bands(temperature: float, band: str) -> None:
    assert band_of(temperature).key == band


def test_known_counts_give_known_values() -> None:
    rows = [
        # code / ngram: 1000 greedy drafted tokens (800 accepted), 500 at t=1 (100 accepted) in two
        # rows, 100 at t=0.7 (too few for a band of its own), 100 with no temperature recorded.
        row("code", "embedded:ngram", 0.0, 1000, 800),
        row("code", "embedded:ngram", 1.0, 300, 70),
        row("code", "embedded:ngram", 1.0, 200, 30),
        row("code", "embedded:ngram", 0.7, 100, 50),
        row("code", "embedded:ngram", None, 100, 60),
        # Nothing drafted, no class, no draft count: nothing to learn from.
        row("code", "embedded:off", 0.0, None, None),
        row(None, "embedded:ngram", 0.0, 500, 500),
        row("qa", "embedded:ngram", 0.0, 0, 0),
    ]
    pooled = (1010 + PSEUDO_TOKENS * DEFAULT_PRIOR) / (1700 + PSEUDO_TOKENS)
    assert acceptance_priors(rows) == {
        "code:ngram": round(pooled, 4),
        "code:ngram@t0": round((800 + PSEUDO_TOKENS * pooled) / (1000 + PSEUDO_TOKENS), 4),
        "code:ngram@t0.9+": round((100 + PSEUDO_TOKENS * pooled) / (500 + PSEUDO_TOKENS), 4),
    }
    assert acceptance_priors(rows)["code:ngram"] == pytest.approx(0.5943, abs=1e-4)


def test_each_level_is_shrunk_toward_the_next() -> None:
    # One short request cannot swing a class: 10 drafted tokens, none accepted, stay near the default.
    assert acceptance_priors([row("qa", "embedded:ngram", 0.0, 10, 0)]) == {
        "qa:ngram": round(PSEUDO_TOKENS * DEFAULT_PRIOR / (10 + PSEUDO_TOKENS), 4)
    }
    # A band just measured enough to stand, all rejected, is pulled a fifth of the way to its class.
    greedy = row("qa", "embedded:ngram", 0.0, 10_000, 9_000)
    rows = [greedy, row("qa", "embedded:ngram", 1.0, BAND_MIN_TOKENS, 0)]
    priors = acceptance_priors(rows)
    assert priors["qa:ngram@t0.9+"] == pytest.approx(
        PSEUDO_TOKENS * priors["qa:ngram"] / (BAND_MIN_TOKENS + PSEUDO_TOKENS), abs=1e-4
    )
    assert 0.15 < priors["qa:ngram@t0.9+"] < 0.2 < 0.85 < priors["qa:ngram"]
    # ... and more of the same makes it approach the measurement.
    more = acceptance_priors([*rows, row("qa", "embedded:ngram", 1.0, 20 * BAND_MIN_TOKENS, 0)])
    assert more["qa:ngram@t0.9+"] < 0.02
    # One token short of the minimum: no band; its tokens count toward the class's pooled prior.
    short = acceptance_priors([rows[0], row("qa", "embedded:ngram", 1.0, BAND_MIN_TOKENS - 1, 0)])
    assert set(short) == {"qa:ngram", "qa:ngram@t0"}
    assert short["qa:ngram"] < acceptance_priors(rows[:1])["qa:ngram"]


def test_lookup_falls_back_band_then_class_then_default() -> None:
    priors = {"code:ngram": 0.7, "code:ngram@t0.9+": 0.2, "code:suffix@t0": 0.9}
    hot = lookup(priors, "code", "ngram", 1.0)
    assert (hot.value, hot.source, hot.band.key, hot.measured) == (0.2, "band", "t0.9+", True)
    # Another band's measurement never answers for this one: the pooled prior does.
    warm = lookup(priors, "code", "ngram", 0.7)
    assert (warm.value, warm.source, warm.band.label, warm.measured) == (0.7, "class", "(0.5, 0.9]", False)
    greedy_suffix = lookup(priors, "code", "suffix", 0.0)
    assert (greedy_suffix.value, greedy_suffix.source) == (0.9, "band")
    hot_suffix = lookup(priors, "code", "suffix", 1.0)
    assert (hot_suffix.value, hot_suffix.source) == (DEFAULT_PRIOR, "default")
    assert lookup(priors, "qa", "ngram", 0.0).source == "default"


def test_banded_priors_round_trip_through_a_stored_version() -> None:
    priors = {"code:ngram": 0.7, "code:ngram@t0.9+": 0.2}
    back = PolicyState.from_dict(json.loads(json.dumps(PolicyState(RuleConfig(), None, priors).as_dict())))
    assert back.priors == priors


def test_a_version_stored_before_the_bands_loads_and_means_what_it_meant() -> None:
    stored = {"rules": RuleConfig().as_dict(), "model": None, "priors": {"code:ngram": 0.81}}
    state = PolicyState.from_dict(json.loads(json.dumps(stored)))
    assert state.priors == {"code:ngram": 0.81}
    # The pooled prior answers at every temperature, and no band counts as measured.
    for t in (0.0, 0.3, 0.7, 1.0):
        p = lookup(state.priors, "code", "ngram", t)
        assert (p.value, p.source, p.measured) == (0.81, "class", False)
