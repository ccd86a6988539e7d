"""SpecParams validation, the per-request speculation counters, and the proposer table."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.engine.outputs import RequestOutput, RequestStats, SpecStats
from specgate.engine.spec_decode.draft_model import DraftModelProposer
from specgate.engine.spec_decode.ngram import NgramProposer
from specgate.engine.spec_decode.proposers import PROPOSERS, proposer_factory, proposer_names
from specgate.engine.vocab import SpecParams, SpecStep


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k_min": 5, "k_max": 4},
        {"k_min": -1},
        {"k_max": -1},
        {"k_max": 65},
        {"k_min": 65, "k_max": 65},
        {"num_speculative_tokens": -1},
        {"num_speculative_tokens": 65},
        {"acceptance_prior": -0.01},
        {"acceptance_prior": 1.01},
    ],
)
def test_spec_params_rejects_out_of_range_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SpecParams(method="ngram", **kwargs)


def test_spec_params_accepts_the_bounds() -> None:
    p = SpecParams(method="ngram", k_min=64, k_max=64, num_speculative_tokens=64, acceptance_prior=1.0)
    assert (p.k_min, p.k_max, p.num_speculative_tokens) == (64, 64, 64)
    p = SpecParams(method="ngram", k_min=0, k_max=0, num_speculative_tokens=0, acceptance_prior=0.0)
    assert p.k_max == 0


def test_spec_params_enabled() -> None:
    assert not SpecParams().enabled  # method "off" by default
    assert SpecParams(method="ngram").enabled
    assert not SpecParams(method="ngram", k_max=0).enabled
    assert not SpecParams(method="off", k_max=8).enabled


def chain(drafted: int, accepted: int) -> SpecStep:
    return SpecStep(drafted, accepted, batch_tokens=drafted + 1, step_ms=1.0, depth=drafted)


def test_spec_stats_record_worked_example() -> None:
    s = SpecStats(method="ngram")
    assert s.mean_acceptance_length == 0.0 and s.draft_acceptance_rate == 0.0
    s.record(chain(3, 2))
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    s.record(chain(4, 4))
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    s.record(chain(2, 0))
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert s.num_drafts == 3
    assert s.num_draft_tokens == 9
    assert s.num_accepted_tokens == 6
    assert [(step.drafted, step.accepted) for step in s.steps] == [(3, 2), (4, 4), (2, 0)]
    # (6 accepted drafts + one recovered or bonus token per step) / 3 steps
    assert s.mean_acceptance_length == pytest.approx(3.0)
    assert s.draft_acceptance_rate == pytest.approx(6 / 9)
    assert s.num_tree_drafts == 0


def test_a_tree_step_counts_by_depth() -> None:
    s = SpecStats(method="suffix")
    s.record(SpecStep(drafted=7, accepted=2, batch_tokens=8, step_ms=1.0, depth=3))  # 7 nodes, 3 deep
    assert s.num_tree_drafts == 1 and s.num_draft_tokens == 7
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]  # position i is depth i + 1
    assert s.steps[0].tree


def test_counters_come_once_with_the_finished_output() -> None:
    stats = RequestStats(arrival_ts=1.0, num_prompt_tokens=4, spec=SpecStats(method="suffix"))
    RequestOutput("r", [1], "a", False, None)  # a step's news: no counters
    done = RequestOutput("r", [2], "b", True, "length", stats)
    assert done.stats is stats
    with pytest.raises(ValueError, match="finished"):
        RequestOutput("r", [1], "a", False, None, stats)
    with pytest.raises(ValueError, match="finished"):
        RequestOutput("r", [2], "b", True, "length")


def test_unknown_proposer_names_the_known_methods() -> None:
    with pytest.raises(ValueError, match="unknown speculation method 'nope'") as info:
        proposer_factory("nope")
    message = str(info.value)
    for name in ("off", "ngram", "suffix", "draft_model", "eagle"):
        assert name in message
    assert proposer_names() == ["draft_model", "eagle", "ngram", "suffix"]
    assert proposer_factory("ngram") is NgramProposer
    assert proposer_factory("draft_model") is DraftModelProposer


def test_the_table_is_explicit_and_read_only() -> None:
    assert "off" not in PROPOSERS
    with pytest.raises(TypeError):
        PROPOSERS["impostor"] = NgramProposer  # type: ignore[index]
