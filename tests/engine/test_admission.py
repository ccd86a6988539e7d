"""Admission: what a request can get wrong is refused with a RequestError before the engine is touched."""

from __future__ import annotations

import re

import pytest
import torch

from specgate.engine.admission import checked_prompt, new_sequence, request_generator
from specgate.engine.errors import ContextLengthExceededError, RequestError
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams

VOCAB, MAX_LEN = 100, 32


@pytest.mark.parametrize(
    ("prompt", "params", "error", "words"),
    [
        ([], SamplingParams(), RequestError, "empty"),
        ([1, 100], SamplingParams(), RequestError, "[0, 100)"),
        ([-1], SamplingParams(), RequestError, "[0, 100)"),
        ([1], SamplingParams(stop_token_ids=[100]), RequestError, "stop_token_ids"),
        ([1] * 20, SamplingParams(max_tokens=13), ContextLengthExceededError, "20 prompt + 13"),
    ],
)
def test_bad_prompts_are_refused_with_the_reason(
    prompt: list[int], params: SamplingParams, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=re.escape(words)):
        checked_prompt(prompt, params, VOCAB, MAX_LEN)


def test_a_prompt_that_fits_exactly_is_taken_as_ints() -> None:
    assert checked_prompt((1, 2, 3), SamplingParams(max_tokens=29), VOCAB, MAX_LEN) == [1, 2, 3]


def test_a_seed_gives_the_same_stream_and_negative_seeds_are_valid() -> None:
    rng = torch.Generator().manual_seed(0)
    a, b = request_generator(-7, "cpu", rng), request_generator(-7, "cpu", rng)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    unseeded = [request_generator(None, "cpu", rng).initial_seed() for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # drawn from the engine's generator, one per request


def test_the_sequence_carries_spec_state_only_when_it_speculates() -> None:
    params = SamplingParams(max_tokens=4)
    gen = torch.Generator()
    plain = new_sequence("a", [1, 2], params, None, gen, None, "")
    spec = new_sequence("b", [1, 2], params, SpecParams(method="ngram"), gen, None, None)
    assert plain.spec is None and plain.stats.spec is None and plain.detokenizer is None
    assert spec.spec is not None and spec.stats.spec is not None and spec.stats.spec.method == "ngram"
    assert spec.prefix_salt is None and spec.num_prompt_tokens == 2 and spec.stats.num_prompt_tokens == 2
