"""SpecParams validation, the per-request speculation counters, and the proposer table."""

from __future__ import annotations

from typing import Any

import pytest

from specgate.engine.outputs import RequestStats, SpecStats
from specgate.engine.spec_decode.draft_model import DraftModelProposer
from specgate.engine.spec_decode.ngram import NgramProposer
from specgate.engine.spec_decode.params import SpecParams
from specgate.engine.spec_decode.proposers import PROPOSERS, proposer_factory, proposer_names


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


def test_spec_stats_record_worked_example() -> None:
    s = SpecStats(method="ngram")
    assert s.mean_acceptance_length == 0.0 and s.draft_acceptance_rate == 0.0
    s.record(3, 2)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    s.record(4, 4)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    s.record(2, 0)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert s.num_drafts == 3
    assert s.num_draft_tokens == 9
    assert s.num_accepted_tokens == 6
    assert s.per_step_drafted == [3, 4, 2]
    assert s.per_step_accepted == [2, 4, 0]
    # (6 accepted drafts + one recovered or bonus token per step) / 3 steps
    assert s.mean_acceptance_length == pytest.approx(3.0)
    assert s.draft_acceptance_rate == pytest.approx(6 / 9)


def test_request_stats_snapshot_does_not_see_later_updates() -> None:
    stats = RequestStats(arrival_time=1.0, num_prompt_tokens=4, spec=SpecStats(method="suffix"))
    assert stats.spec is not None
    stats.spec.record(2, 1)
    stats.token_times.append(2.0)
    stats.num_output_tokens = 2
    snap = stats.snapshot()
    stats.spec.record(4, 4)
    stats.token_times.append(3.0)
    stats.num_output_tokens = 6
    assert snap.spec is not None and snap.spec is not stats.spec
    assert snap.spec.num_accepted_tokens_per_pos == [1, 0]
    assert snap.spec.per_step_drafted == [2]
    assert snap.spec.per_step_accepted == [1]
    assert snap.spec.num_drafts == 1 and snap.spec.num_draft_tokens == 2
    assert snap.token_times == [2.0]
    assert snap.num_output_tokens == 2
    assert stats.spec.num_accepted_tokens_per_pos == [2, 1, 1, 1]  # the original did change
    assert RequestStats(arrival_time=0.0, num_prompt_tokens=1).snapshot().spec is None


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
