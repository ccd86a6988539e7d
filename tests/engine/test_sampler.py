"""Sampler: logits processing (penalties, temperature, top-k/p, min-p), sampling and logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare

from specgate.engine.sampler import SamplingRow, draw, process_logits, sample, token_logprobs
from specgate.engine.sampling_params import MAX_LOGPROBS, SamplingParams

VOCAB = 96
NEG_INF = float("-inf")


def row(
    token_ids: Sequence[int] = (),
    num_prompt_tokens: int | None = None,
    generator: torch.Generator | None = None,
    suppress: Sequence[int] = (),
    **params: object,
) -> SamplingRow:
    n_prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
    return SamplingRow(SamplingParams(**params), list(token_ids), n_prompt, generator, tuple(suppress))  # type: ignore[arg-type]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(processed: torch.Tensor) -> set[int]:
    """Indices of a 1-D processed row that were not masked."""
    return set(torch.isfinite(processed).nonzero().flatten().tolist())


def logits_with_argmax(chosen: Sequence[int], vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Random logits where row i's maximum is at chosen[i] (vLLM's test construction)."""
    logits = torch.randn(len(chosen), vocab, generator=gen(seed))
    for i, tok in enumerate(chosen):
        logits[i, tok] = logits[i].max() + 1.0
    return logits


# ---- greedy ---------------------------------------------------------------------------------


def test_greedy_rows_return_the_argmax_tokens() -> None:
    chosen = [3, 17, 95, 0, 42, 42]
    logits = logits_with_argmax(chosen)
    rows = [row(temperature=0.0) for _ in chosen]
    assert sample(process_logits(logits, rows), rows) == chosen


@pytest.mark.parametrize("temperature", [0.01, 0.5, 1.0, 3.0])
def test_temperature_does_not_affect_greedy_rows(temperature: float) -> None:
    chosen = [5, 60, 1]
    logits = logits_with_argmax(chosen, seed=1)
    rows = [row(temperature=temperature, top_k=1) for _ in chosen]
    assert all(r.params.greedy for r in rows)
    processed = process_logits(logits, rows)
    reference = process_logits(logits, [row(temperature=1.0, top_k=1) for _ in chosen])
    assert torch.equal(processed, reference)
    assert sample(processed, rows) == chosen


def test_temperature_zero_leaves_logits_unscaled() -> None:
    logits = torch.randn(2, VOCAB, generator=gen(2))
    processed = process_logits(logits, [row(temperature=0.0), row(temperature=0.0)])
    assert torch.equal(processed, logits)
    assert torch.isfinite(processed).all()


def test_greedy_and_random_rows_mix_in_one_batch() -> None:
    chosen = [7, 8, 9]
    logits = logits_with_argmax(chosen, seed=3)
    logits[1] = NEG_INF
    logits[1, 50] = 0.0  # a random row with a single possible token
    rows = [row(temperature=0.0), row(temperature=1.0, generator=gen(0)), row(top_k=1)]
    assert sample(process_logits(logits, rows), rows) == [7, 50, 9]


# ---- top-k / top-p / min-p ------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 50, 95])
def test_top_k_keeps_exactly_the_k_highest_logits(k: int) -> None:
    logits = torch.randn(1, VOCAB, generator=gen(k))
    processed = process_logits(logits, [row(top_k=k)])[0]
    expected = set(logits[0].topk(k).indices.tolist())
    assert kept(processed) == expected
    idx = sorted(expected)
    assert torch.equal(processed[idx], logits[0, idx])  # survivors are unchanged (temperature 1)


@pytest.mark.parametrize("k", [0, VOCAB, VOCAB + 10])
def test_top_k_disabled_or_at_least_vocab_keeps_everything(k: int) -> None:
    logits = torch.randn(1, VOCAB, generator=gen(4))
    assert torch.equal(process_logits(logits, [row(top_k=k)]), logits)


# Probabilities [0.5, 0.3, 0.15, 0.05] placed at shuffled vocabulary positions.
_TOP_P_PROBS = [0.5, 0.3, 0.15, 0.05]
_TOP_P_POSITIONS = [2, 0, 3, 1]


@pytest.mark.parametrize(
    ("top_p", "n_kept"), [(0.3, 1), (0.5, 1), (0.51, 2), (0.79, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)]
)
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p: float, n_kept: int) -> None:
    logits = torch.full((1, 4), NEG_INF)
    for pos, p in zip(_TOP_P_POSITIONS, _TOP_P_PROBS, strict=True):
        logits[0, pos] = math.log(p)
    processed = process_logits(logits, [row(top_p=top_p)])[0]
    assert kept(processed) == set(_TOP_P_POSITIONS[:n_kept])
    probs = processed.softmax(-1)
    expected = torch.zeros(4)
    for pos, p in zip(_TOP_P_POSITIONS[:n_kept], _TOP_P_PROBS[:n_kept], strict=True):
        expected[pos] = p / sum(_TOP_P_PROBS[:n_kept])
    torch.testing.assert_close(probs, expected)


def test_top_p_is_applied_after_temperature() -> None:
    # T=1: exclusive cumulative masses 0, 0.5, 0.8, 0.95 -> top_p=0.7 keeps 2 tokens.
    # T=2: probabilities ~ sqrt(p) = [0.379, 0.293, 0.208, 0.120], masses 0, 0.379, 0.672, 0.880 -> 3 tokens.
    logits = torch.tensor([[math.log(p) for p in _TOP_P_PROBS]])
    assert kept(process_logits(logits, [row(top_p=0.7)])[0]) == {0, 1}
    assert kept(process_logits(logits, [row(top_p=0.7, temperature=2.0)])[0]) == {0, 1, 2}


def test_top_k_and_top_p_combine() -> None:
    logits = torch.tensor([[math.log(p) for p in _TOP_P_PROBS]])
    assert kept(process_logits(logits, [row(top_k=3, top_p=0.9)])[0]) == {0, 1, 2}
    assert kept(process_logits(logits, [row(top_k=2, top_p=0.9)])[0]) == {0, 1}
    assert kept(process_logits(logits, [row(top_k=3, top_p=0.6)])[0]) == {0, 1}


@pytest.mark.parametrize(("min_p", "n_kept"), [(0.0, 4), (0.05, 4), (0.25, 3), (0.5, 2), (0.9, 1), (1.0, 1)])
def test_min_p_drops_tokens_below_min_p_times_max_prob(min_p: float, n_kept: int) -> None:
    logits = torch.tensor([[math.log(p) for p in _TOP_P_PROBS]])
    processed = process_logits(logits, [row(min_p=min_p)])[0]
    assert kept(processed) == set(range(n_kept))


@pytest.mark.parametrize(
    "params",
    [
        dict(top_k=1),
        dict(top_p=1e-6),
        dict(min_p=1.0),
        dict(top_k=1, top_p=1e-6, min_p=1.0, temperature=0.1),
        dict(top_p=1e-6, temperature=50.0),
    ],
)
def test_best_token_is_never_dropped(params: dict) -> None:
    logits = torch.randn(8, VOCAB, generator=gen(5)) * 4
    rows = [row(**params) for _ in range(8)]
    processed = process_logits(logits, rows)
    best = logits.argmax(-1).tolist()
    for i in range(8):
        assert kept(processed[i]) == {best[i]}


# ---- penalties and suppression --------------------------------------------------------------


def base_logits() -> torch.Tensor:
    logits = torch.zeros(1, 8)
    logits[0, :6] = torch.tensor([1.0, 2.0, -1.0, 4.0, -3.0, 0.5])
    return logits


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # Prompt [1, 2], output [2, 3, 3]: tokens 1, 2, 3 are seen; 0, 4, 5, 6, 7 are not.
    r = row([1, 2, 2, 3, 3], num_prompt_tokens=2, repetition_penalty=2.0)
    processed = process_logits(base_logits(), [r])[0]
    expected = torch.tensor([1.0, 1.0, -2.0, 2.0, -3.0, 0.5, 0.0, 0.0])
    torch.testing.assert_close(processed, expected)


def test_repetition_penalty_counts_prompt_only_tokens() -> None:
    r = row([4, 0], num_prompt_tokens=2, repetition_penalty=1.5)  # no output yet
    processed = process_logits(base_logits(), [r])[0]
    expected = base_logits()[0]
    expected[0] = 1.0 / 1.5
    expected[4] = -3.0 * 1.5
    torch.testing.assert_close(processed, expected)


def test_frequency_penalty_subtracts_output_counts_only() -> None:
    r = row([1, 2, 2, 3, 3], num_prompt_tokens=2, frequency_penalty=0.5)
    processed = process_logits(base_logits(), [r])[0]
    # Token 1 is only in the prompt: untouched. Token 2 once in the output, token 3 twice.
    expected = torch.tensor([1.0, 2.0, -1.5, 3.0, -3.0, 0.5, 0.0, 0.0])
    torch.testing.assert_close(processed, expected)


def test_presence_penalty_subtracts_once_for_output_tokens_only() -> None:
    r = row([1, 2, 2, 3, 3], num_prompt_tokens=2, presence_penalty=0.25)
    processed = process_logits(base_logits(), [r])[0]
    expected = torch.tensor([1.0, 2.0, -1.25, 3.75, -3.0, 0.5, 0.0, 0.0])
    torch.testing.assert_close(processed, expected)


def test_negative_frequency_and_presence_penalties_raise_logits() -> None:
    r = row([0, 5, 5], num_prompt_tokens=1, frequency_penalty=-1.0, presence_penalty=-0.5)
    processed = process_logits(base_logits(), [r])[0]
    expected = base_logits()[0]
    expected[5] += 2 * 1.0 + 0.5
    torch.testing.assert_close(processed, expected)


def test_all_penalties_combine_repetition_first() -> None:
    r = row(
        [1, 2, 2, 3, 3],
        num_prompt_tokens=2,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    processed = process_logits(base_logits(), [r])[0]
    expected = torch.tensor([1.0, 1.0, -2.0 - 0.75, 2.0 - 1.25, -3.0, 0.5, 0.0, 0.0])
    torch.testing.assert_close(processed, expected)


def test_penalties_apply_to_greedy_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    no_penalty = row([0, 1], num_prompt_tokens=1, temperature=0.0)
    penalised = row([0, 1], num_prompt_tokens=1, temperature=0.0, presence_penalty=1.0)
    rows = [no_penalty, penalised]
    assert sample(process_logits(logits.repeat(2, 1), rows), rows) == [1, 2]


def test_logit_bias_adds_to_the_listed_tokens_only() -> None:
    r = row([1], logit_bias={0: -1.5, 3: 0.25, 7: 100.0})
    processed = process_logits(base_logits(), [r])[0]
    expected = torch.tensor([-0.5, 2.0, -1.0, 4.25, -3.0, 0.5, 0.0, 100.0])
    torch.testing.assert_close(processed, expected)


def test_logit_bias_applies_after_penalties_and_before_temperature() -> None:
    r = row([3, 3], num_prompt_tokens=1, presence_penalty=1.0, temperature=0.5, logit_bias={3: 1.0})
    processed = process_logits(base_logits(), [r])[0]
    assert processed[3].item() == pytest.approx((4.0 - 1.0 + 1.0) / 0.5)
    assert processed[1].item() == pytest.approx(2.0 / 0.5)


def test_logit_bias_bans_and_forces_greedy_choices_per_row() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]]).repeat(3, 1)
    rows = [
        row([0], temperature=0.0),
        row([0], temperature=0.0, logit_bias={1: -100.0}),
        row([0], temperature=0.0, logit_bias={0: 100.0}),
    ]
    assert sample(process_logits(logits, rows), rows) == [1, 2, 0]


def test_logit_bias_keeps_suppressed_tokens_suppressed_and_ignores_ids_past_the_vocab() -> None:
    r = row([1], suppress=[3], logit_bias={3: 100.0, 10_000: 5.0})
    processed = process_logits(base_logits(), [r])[0]
    assert processed[3].item() == NEG_INF
    torch.testing.assert_close(processed[:3], base_logits()[0, :3])


@pytest.mark.parametrize("bias", [{-1: 1.0}, {2: 100.5}, {2: float("nan")}, {2: float("-inf")}])
def test_sampling_params_refuse_a_bad_logit_bias(bias: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_sampling_params_normalize_an_empty_logit_bias_to_none() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={"4": 2}).logit_bias == {4: 2.0}  # type: ignore[dict-item]


def test_penalties_ignore_prompt_for_frequency_even_when_output_is_empty() -> None:
    r = row([1, 1, 1], frequency_penalty=2.0, presence_penalty=2.0)
    assert torch.equal(process_logits(base_logits(), [r]), base_logits())


def test_suppressed_tokens_become_minus_inf() -> None:
    logits = logits_with_argmax([10, 10])
    rows = [row(temperature=0.0, suppress=[10, 11]), row(temperature=0.0)]
    processed = process_logits(logits, rows)
    assert processed[0, 10] == NEG_INF and processed[0, 11] == NEG_INF
    assert torch.isfinite(processed[0, [i for i in range(VOCAB) if i not in (10, 11)]]).all()
    assert torch.isfinite(processed[1]).all()
    tokens = sample(processed, rows)
    assert tokens[0] not in (10, 11) and tokens[1] == 10
    assert tokens[0] == int(processed[0].argmax())


def test_suppressed_tokens_are_never_sampled() -> None:
    logits = torch.zeros(500, 6)
    logits[:, 0] = 5.0
    rows = [row(suppress=[0, 3], generator=gen(i)) for i in range(500)]
    drawn = set(sample(process_logits(logits, rows), rows))
    assert drawn == {1, 2, 4, 5}


def test_process_logits_does_not_modify_its_input() -> None:
    logits = torch.randn(2, VOCAB, generator=gen(6))
    before = logits.clone()
    rows = [
        row([1, 2, 3], num_prompt_tokens=1, repetition_penalty=1.3, frequency_penalty=1.0, top_k=5),
        row(),
    ]
    process_logits(logits, rows)
    assert torch.equal(logits, before)


def test_process_logits_returns_float32_for_half_input() -> None:
    logits = torch.randn(2, VOCAB, generator=gen(7)).to(torch.bfloat16)
    out = process_logits(logits, [row(top_k=3), row(temperature=0.5)])
    assert out.dtype == torch.float32


# ---- row independence -----------------------------------------------------------------------


def mixed_rows() -> list[SamplingRow]:
    return [
        row(temperature=0.0),
        row([3, 4, 4], num_prompt_tokens=1, temperature=0.7, top_k=10, repetition_penalty=1.2),
        row(temperature=1.3, top_p=0.8),
        row([9, 9, 9, 8], num_prompt_tokens=2, min_p=0.1, frequency_penalty=0.4, presence_penalty=-0.3),
        row(suppress=[0, 1, 2], top_k=40, top_p=0.95, min_p=0.02),
        row(temperature=0.5),
    ]


def test_rows_are_processed_independently() -> None:
    rows = mixed_rows()
    logits = torch.randn(len(rows), VOCAB, generator=gen(8))
    batched = process_logits(logits, rows)
    for i, r in enumerate(rows):
        alone = process_logits(logits[i : i + 1], [r])[0]
        assert torch.equal(batched[i], alone), f"row {i} depends on the other rows"
    # And in reverse order.
    reversed_out = process_logits(logits.flip(0), rows[::-1])
    assert torch.equal(reversed_out.flip(0), batched)


@pytest.mark.parametrize("neighbour", [dict(top_k=5), dict(top_p=0.9), dict(top_k=50, top_p=0.99)])
def test_untruncated_row_keeps_every_token_next_to_a_truncating_row(neighbour: dict) -> None:
    """A row with top_k=0, top_p=1, min_p=0 asks for no truncation, whatever else is in the batch.

    With a realistic vocabulary the float32 cumulative sum of the sorted probabilities reaches 1.0
    before the tail, so masking with `cumsum - probs >= top_p` at top_p=1.0 must not be applied to
    rows that did not ask for top-p.
    """
    vocab = 32_000
    logits = torch.randn(1, vocab, generator=gen(9)) * 4
    plain = row()
    alone = process_logits(logits, [plain])[0]
    assert torch.isfinite(alone).all()
    batched = process_logits(logits.repeat(2, 1), [plain, row(**neighbour)])
    assert torch.equal(batched[1], process_logits(logits, [row(**neighbour)])[0])
    assert len(kept(batched[1])) < vocab
    lost = ~torch.isfinite(batched[0])
    lost_mass = float(logits[0].softmax(-1)[lost].sum())
    assert not lost.any(), (
        f"{int(lost.sum())} tokens (mass {lost_mass:.2e}) masked by the neighbour's truncation"
    )
    assert torch.equal(batched[0], alone)


def test_seeded_rows_sample_the_same_tokens_whatever_shares_the_batch() -> None:
    target_logits = torch.randn(1, VOCAB, generator=gen(10))

    def draws(n_before: int, n_after: int) -> list[int]:
        g = gen(1234)
        out: list[int] = []
        for step in range(30):
            n_others = n_before + n_after
            others = [
                row(temperature=0.8, top_k=7, min_p=0.05, generator=gen(step + j)) for j in range(n_others)
            ]
            rows = [*others[:n_before], row(temperature=0.9, generator=g), *others[n_before:]]
            other_logits = torch.randn(n_others, VOCAB, generator=gen(100 + step)) * 3
            logits = torch.cat([other_logits[:n_before], target_logits, other_logits[n_before:]])
            out.append(sample(process_logits(logits, rows), rows)[n_before])
        return out

    alone = draws(0, 0)
    assert len(set(alone)) > 5  # really random
    assert draws(2, 1) == alone
    assert draws(0, 5) == alone


# ---- seeded sampling and distributions ------------------------------------------------------


def test_same_seed_gives_identical_draws_and_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)

    def draws(seed: int) -> list[int]:
        g = gen(seed)
        r = row(generator=g)
        return [sample(process_logits(logits, [r]), [r])[0] for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_seeded_rows_in_one_batch_use_their_own_generators() -> None:
    logits = torch.zeros(4, VOCAB)
    rows = [row(generator=gen(s)) for s in (1, 2, 1, 2)]
    tokens = [sample(process_logits(logits, rows), rows) for _ in range(20)]
    assert [t[0] for t in tokens] == [t[2] for t in tokens]
    assert [t[1] for t in tokens] == [t[3] for t in tokens]
    assert [t[0] for t in tokens] != [t[1] for t in tokens]


_DIST = [0.4, 0.25, 0.2, 0.1, 0.05]


def _empirical(params: dict, seed: int, n_rows: int = 2000, n_batches: int = 10) -> torch.Tensor:
    logits = torch.tensor([math.log(p) for p in _DIST]).repeat(n_rows, 1)
    g = gen(seed)
    counts = torch.zeros(len(_DIST))
    for _ in range(n_batches):
        rows = [row(generator=g, **params) for _ in range(n_rows)]
        tokens = sample(process_logits(logits, rows), rows)
        counts += torch.bincount(torch.tensor(tokens), minlength=len(_DIST)).float()
    return counts


def _renormalised(probs: list[float]) -> list[float]:
    total = sum(probs)
    return [p / total for p in probs]


@pytest.mark.parametrize(
    ("params", "target"),
    [
        (dict(temperature=1.0), _DIST),
        (dict(temperature=1.0, top_k=3), [*_renormalised(_DIST[:3]), 0.0, 0.0]),
        # Exclusive cumulative masses: 0, 0.4, 0.65, 0.85, 0.95 -> top_p=0.6 keeps two tokens.
        (dict(temperature=1.0, top_p=0.6), [*_renormalised(_DIST[:2]), 0.0, 0.0, 0.0]),
        (dict(temperature=1.0, top_k=4, top_p=0.9), [*_renormalised(_DIST[:4]), 0.0]),
        # softmax(log(p) / 0.5) is proportional to p**2.
        (dict(temperature=0.5), _renormalised([p**2 for p in _DIST])),
        (dict(temperature=2.0), _renormalised([p**0.5 for p in _DIST])),
        # min_p=0.3: threshold 0.12, so 0.1 and 0.05 go.
        (dict(temperature=1.0, min_p=0.3), [*_renormalised(_DIST[:3]), 0.0, 0.0]),
    ],
)
@pytest.mark.slow
def test_sampling_converges_to_the_processed_distribution(params: dict, target: list[float]) -> None:
    counts = _empirical(params, seed=42)
    n = counts.sum().item()
    assert n == 20_000
    target_t = torch.tensor(target)
    support = target_t > 0
    assert counts[~support].sum() == 0, "a masked token was sampled"
    observed = counts[support].numpy()
    expected = (target_t[support] * n).numpy()
    expected = expected * observed.sum() / expected.sum()
    _, p_value = chisquare(observed, expected)
    assert p_value > 1e-3, f"counts {counts.tolist()} do not match {target}"
    freq = counts / n
    assert (freq - target_t).abs().max() < 0.015


@pytest.mark.slow
def test_temperature_half_sharpens_the_distribution() -> None:
    base = _empirical(dict(temperature=1.0), seed=3) / 20_000
    sharp = _empirical(dict(temperature=0.5), seed=4) / 20_000
    assert sharp[0] > base[0] + 0.1  # 0.58 vs 0.40
    assert (sharp[2:] < base[2:]).all()


# ---- logprobs -------------------------------------------------------------------------------


def test_token_logprobs_use_raw_logits_and_list_top_n_best_first() -> None:
    logits = torch.randn(4, VOCAB, generator=gen(11)) * 3
    rows = [
        row(logprobs=5, temperature=0.3, top_k=2, repetition_penalty=1.5, generator=gen(0)),
        row(logprobs=None),
        row(logprobs=0, temperature=0.0),
        row(logprobs=MAX_LOGPROBS, top_p=0.5, generator=gen(1)),
    ]
    chosen = [int(logits[0].argsort()[10]), 7, int(logits[2].argmax()), int(logits[3].argmin())]
    out = token_logprobs(logits, chosen, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    for i, n_top in ((0, 5), (2, 0), (3, MAX_LOGPROBS)):
        lp = out[i]
        assert lp is not None
        assert lp.token_id == chosen[i]
        assert lp.logprob == pytest.approx(float(raw[i, chosen[i]]), abs=1e-5)
        assert len(lp.top) == n_top
        ids = [t for t, _ in lp.top]
        vals = [v for _, v in lp.top]
        assert ids == raw[i].topk(n_top).indices.tolist()
        assert vals == sorted(vals, reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(float(raw[i, t]), abs=1e-5)
    assert out[2] is not None and out[2].top == []


def test_token_logprobs_all_none_when_not_requested() -> None:
    logits = torch.randn(3, VOCAB, generator=gen(12))
    assert token_logprobs(logits, [1, 2, 3], [row(), row(), row()]) == [None, None, None]


def test_token_logprobs_of_half_logits_are_float() -> None:
    logits = torch.randn(1, VOCAB, generator=gen(13)).to(torch.bfloat16)
    lp = token_logprobs(logits, [4], [row(logprobs=1)])[0]
    assert lp is not None
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits.float(), -1)[0, 4]), abs=1e-5)
    assert isinstance(lp.top[0][0], int) and isinstance(lp.top[0][1], float)


# ---- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=-0.5),
        dict(top_k=-1),
        dict(min_p=1.01),
        dict(min_p=-0.1),
        dict(presence_penalty=2.01),
        dict(presence_penalty=-2.01),
        dict(frequency_penalty=2.5),
        dict(frequency_penalty=-3.0),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=-1.0),
        dict(max_tokens=0),
        dict(max_tokens=-3),
        dict(stop=""),
        dict(stop=["ok", ""]),
        dict(logprobs=MAX_LOGPROBS + 1),
        dict(logprobs=-1),
        dict(min_tokens=5, max_tokens=4),
        dict(min_tokens=-1),
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-9),
        dict(top_k=0),
        dict(min_p=1.0),
        dict(min_p=0.0),
        dict(presence_penalty=2.0, frequency_penalty=-2.0),
        dict(repetition_penalty=1e-3),
        dict(max_tokens=1),
        dict(logprobs=0),
        dict(logprobs=MAX_LOGPROBS),
        dict(min_tokens=4, max_tokens=4),
    ],
)
def test_boundary_sampling_params_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_greedy_and_has_penalties_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1, temperature=0.9).greedy
    assert not SamplingParams(top_k=2).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.1).has_penalties
    assert SamplingParams(frequency_penalty=0.1).has_penalties


# ---- draw: one index from a law, by its inverted cumulative sum --------------------------------


def test_draw_follows_the_law_and_never_draws_an_index_without_mass() -> None:
    # Unnormalized, zeros at both ends and in the middle: a draw that ignored the total, or shifted
    # the found index by one, would land on a zero or skew the counts.
    law = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 5.0, 0.0])
    g = gen(7)
    n = 20_000
    counts = torch.bincount(torch.tensor([draw(law, g) for _ in range(n)]), minlength=law.numel())
    assert counts[law == 0].sum() == 0
    kept = law > 0
    expected = (law[kept] / law.sum() * n).tolist()
    assert chisquare(counts[kept].tolist(), expected).pvalue > 1e-3


def test_draw_at_the_top_of_the_unit_interval_takes_the_last_index_with_mass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # u * total can round up to the total itself; the last indices hold nothing here.
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.2, 0.3, 0.5, 0.0, 0.0]), None) == 2


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_draw_refuses_a_law_without_a_positive_finite_total(bad: list[float]) -> None:
    with pytest.raises(RuntimeError, match="total"):
        draw(torch.tensor(bad), gen(0))
