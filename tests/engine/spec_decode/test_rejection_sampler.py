"""Rejection sampler: accepted / recovered / bonus tokens, and losslessness as a distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specgate.engine.sampler import SamplingRow, process_logits
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.rejection_sampler import verify_greedy, verify_sampled

VOCAB = 6


def picks(*tokens: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits [len(tokens), vocab] whose argmax in row i is tokens[i]."""
    logits = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        logits[i, t] = 10.0
    return logits


def test_greedy_all_accepted_adds_the_bonus_token() -> None:
    v = verify_greedy(picks(1, 2, 3, 4), [1, 2, 3])
    assert v.token_ids == [1, 2, 3, 4] and v.num_accepted == 3


def test_greedy_first_mismatch_emits_the_target_token() -> None:
    v = verify_greedy(picks(1, 5, 3, 4), [1, 2, 3])
    assert v.token_ids == [1, 5] and v.num_accepted == 1
    v = verify_greedy(picks(0, 2), [1])
    assert v.token_ids == [0] and v.num_accepted == 0


def test_no_draft_is_plain_sampling() -> None:
    assert verify_greedy(picks(3), []).token_ids == [3]
    g = torch.Generator().manual_seed(0)
    assert verify_sampled(picks(3) * 10, [], None, g).token_ids == [3]


def test_point_mass_draft_the_target_is_sure_of_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampled(picks(2, 4) * 10, [2], None, g)
        assert v.token_ids == [2, 4]


def test_point_mass_draft_the_target_rules_out_is_replaced() -> None:
    logits = torch.tensor([[0.0, 0.0, float("-inf"), 0.0, 0.0, 0.0], [0.0] * VOCAB])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        v = verify_sampled(logits, [2], None, g)
        assert v.num_accepted == 0 and v.token_ids[0] != 2


def _target_rows() -> list[SamplingRow]:
    params = SamplingParams(temperature=0.7, top_p=0.9)
    return [SamplingRow(params, [0], 1, None), SamplingRow(params, [0], 1, None)]


@pytest.mark.parametrize("proposer", ["point_mass", "draft_distribution"])
def test_emitted_tokens_follow_the_target_distribution(proposer: str) -> None:
    """Chi-square: the first emitted token is distributed as the processed target p, and the
    second (bonus or following a recovery) as p's next-position law, for either kind of draft."""
    torch.manual_seed(0)
    raw_target = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.3, 1.2, -0.4, 0.8, 0.0, 1.0]])
    rows = _target_rows()
    processed = process_logits(raw_target, rows)  # temperature 0.7 and top-p 0.9 applied
    p = processed.softmax(-1)
    raw_draft = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.5, 0.0]])
    q = process_logits(raw_draft, rows[:1]).softmax(-1)  # [1, vocab], same processing
    g = torch.Generator().manual_seed(1234)
    n = 8_000
    first = torch.zeros(VOCAB)
    second_after_accept = torch.zeros(VOCAB)
    accepted = 0
    for _ in range(n):
        if proposer == "point_mass":
            d, probs = [1], None  # a deterministic proposer always drafts token 1
        else:
            d, probs = [int(torch.multinomial(q[0], 1, generator=g))], q
        v = verify_sampled(processed, d, probs, g)
        first[v.token_ids[0]] += 1
        if v.num_accepted == 1:
            accepted += 1
            second_after_accept[v.token_ids[1]] += 1
    assert 0 < accepted < n  # both branches ran
    support = p[0] > 0
    assert (first[~support] == 0).all()  # top-p removed tokens never appear
    assert chisquare(first[support], p[0][support] * n).pvalue > 1e-3
    assert (first / n - p[0]).abs().max() < 0.02
    support2 = p[1] > 0
    assert chisquare(second_after_accept[support2], p[1][support2] * accepted).pvalue > 1e-3
