"""The stop rules on hand-built sequences: min_tokens suppression, and each reason a sequence ends."""

from __future__ import annotations

import pytest
import torch

from specgate.engine.outputs import RequestStats
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.sequence import Sequence
from specgate.engine.stop_rules import may_stop, sampling_row, stop_after

EOS = frozenset({2})
PROMPT = [5, 6, 7]


def seq_with(output: list[int], **params: object) -> Sequence:
    p = SamplingParams(**params)  # type: ignore[arg-type]
    return Sequence(
        "r", [*PROMPT, *output], len(PROMPT), p, torch.Generator(), RequestStats(0.0, len(PROMPT))
    )


def test_eos_and_stop_tokens_are_suppressed_until_min_tokens_counting_drafted_tokens() -> None:
    seq = seq_with([9], min_tokens=3, stop_token_ids=[11])
    assert set(sampling_row(seq, [], EOS).suppress_token_ids) == {11, 2}
    # A draft row after one drafted token is the third output position: still suppressed.
    assert set(sampling_row(seq, [4], EOS).suppress_token_ids) == {11, 2}
    # After two drafted tokens the row samples the fourth: stopping is allowed there.
    row = sampling_row(seq, [4, 4], EOS)
    assert row.suppress_token_ids == () and list(row.token_ids) == [*PROMPT, 9, 4, 4]


def test_ignore_eos_keeps_eos_drawable_but_not_the_stop_tokens() -> None:
    seq = seq_with([], min_tokens=2, stop_token_ids=[11], ignore_eos=True)
    assert sampling_row(seq, [], EOS).suppress_token_ids == (11,)


@pytest.mark.parametrize(
    ("output", "params", "expected"),
    [
        ([4, 11], {"stop_token_ids": [11]}, ("stop", 11)),
        ([4, 2], {}, ("stop", None)),
        ([4, 2], {"ignore_eos": True}, None),
        ([4, 4], {"max_tokens": 2}, ("length", None)),
        ([4, 4], {"max_tokens": 3}, None),
        # Before min_tokens neither EOS nor a stop token ends it.
        ([2], {"min_tokens": 2}, None),
        ([11], {"min_tokens": 2, "stop_token_ids": [11]}, None),
        ([4, 11], {"min_tokens": 2, "stop_token_ids": [11]}, ("stop", 11)),
    ],
)
def test_each_reason_to_end(output: list[int], params: dict[str, object], expected: object) -> None:
    seq = seq_with(output, **params)
    assert stop_after(seq, output[-1], None, 100, EOS) == expected


def test_a_stop_string_counts_only_once_stopping_is_allowed() -> None:
    assert stop_after(seq_with([4, 4]), 4, "END", 100, EOS) == ("stop", "END")
    early = seq_with([4], min_tokens=2)
    assert not may_stop(early) and stop_after(early, 4, "END", 100, EOS) is None


def test_the_context_limit_ends_a_sequence_as_length() -> None:
    seq = seq_with([4, 4], max_tokens=50)
    assert stop_after(seq, 4, None, len(PROMPT) + 2, EOS) == ("length", None)
    assert stop_after(seq, 4, None, len(PROMPT) + 3, EOS) is None
