"""Rejection sampler: accepted / recovered / bonus tokens, and losslessness as a distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specgate.engine.sampler import SamplingRow, process_logits
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.rejection_sampler import (
    verify_greedy,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)

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
@pytest.mark.slow
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


# ---- trees -----------------------------------------------------------------------------------
# Root r with children 1 (node 0) and 2 (node 3); node 0 has children 3 (node 1) and 4 (node 2);
# node 3 has child 5 (node 4). Logit row 0 is the root's, row i + 1 node i's.
TREE_TOKENS = [1, 3, 4, 2, 5]
TREE_PARENTS = [-1, 0, 0, -1, 3]


def test_tree_greedy_follows_the_argmax_down_a_second_branch() -> None:
    # The target picks 2 at the root (node 3, the root's second child), then 5 (node 4), then 0.
    logits = picks(2, 0, 0, 0, 5, 0)
    v = verify_tree_greedy(logits, TREE_TOKENS, TREE_PARENTS)
    assert v.path == [3, 4] and v.token_ids == [2, 5, 0]


def test_tree_greedy_takes_a_second_child_deeper_down() -> None:
    v = verify_tree_greedy(picks(1, 4, 0, 3, 0, 0), TREE_TOKENS, TREE_PARENTS)
    assert v.path == [0, 2] and v.token_ids == [1, 4, 3]  # node 2's row picks the bonus token 3


def test_tree_greedy_rejects_everything() -> None:
    v = verify_tree_greedy(picks(0, 0, 0, 0, 0, 0), TREE_TOKENS, TREE_PARENTS)
    assert v.path == [] and v.token_ids == [0]


def test_a_chain_as_a_tree_verifies_like_a_chain() -> None:
    logits = picks(1, 2, 5, 4)
    chain = verify_greedy(logits, [1, 2, 3])
    tree = verify_tree_greedy(logits, [1, 2, 3], dt_chain(3))
    assert tree.token_ids == chain.token_ids and len(tree.path) == chain.num_accepted


def dt_chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def _tree_target() -> torch.Tensor:
    """Processed target logits [6, 6], one row per tree position, with some tokens ruled out."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, VOCAB, generator=gen) * 1.2
    logits[0, 4] = float("-inf")  # the target never emits 4 first
    logits[1, 3] = float("-inf")  # node 0's child 3 is impossible under the target
    return logits


@pytest.mark.parametrize("draft", ["point_mass", "sampled_without_replacement"])
@pytest.mark.slow
def test_tree_emits_tokens_distributed_as_the_target(draft: str) -> None:
    """Chi-square at three depths of a tree with branching 2: the first emitted token follows the
    root's law, the second the law of the child accepted first (node 0 or node 3), the third (after
    nodes 3 then 4) node 4's law; for deterministic trees, and for a root whose two children are
    sampled without replacement from a draft law q (each with its own q given the sibling before)."""
    processed = _tree_target()
    p = processed.softmax(-1)
    g = torch.Generator().manual_seed(99)
    q_root = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.05, 0.1])
    n = 12_000
    first = torch.zeros(VOCAB)
    second = {0: torch.zeros(VOCAB), 3: torch.zeros(VOCAB)}  # by the node accepted first
    third = torch.zeros(VOCAB)
    for _ in range(n):
        tokens, probs = list(TREE_TOKENS), None
        if draft == "sampled_without_replacement":
            a = int(torch.multinomial(q_root, 1, generator=g))
            q2 = q_root.clone()
            q2[a] = 0.0
            q2 /= q2.sum()
            b = int(torch.multinomial(q2, 1, generator=g))
            tokens[0], tokens[3] = a, b
            probs = torch.zeros(5, VOCAB)
            probs[0], probs[3] = q_root, q2
            for i in (1, 2, 4):
                probs[i, tokens[i]] = 1.0  # the deeper nodes stay deterministic: point masses
        v = verify_tree_sampled(processed, tokens, TREE_PARENTS, probs, g)
        assert len(v.token_ids) == len(v.path) + 1
        assert all(tokens[node] == t for node, t in zip(v.path, v.token_ids, strict=False))
        first[v.token_ids[0]] += 1
        if v.path:
            second[v.path[0]][v.token_ids[1]] += 1
        if v.path == [3, 4]:
            third[v.token_ids[2]] += 1
    assert (first[p[0] == 0] == 0).all()
    s0 = p[0] > 0
    assert chisquare(first[s0], p[0][s0] * n).pvalue > 1e-3
    for node, row in ((0, 1), (3, 4)):
        counts = second[node]
        m = float(counts.sum())
        assert m > 500
        s = p[row] > 0
        assert (counts[~s] == 0).all()
        assert chisquare(counts[s], p[row][s] * m).pvalue > 1e-3
    m = float(third.sum())
    assert m > 60  # the path through the root's second child, then its child
    assert chisquare(third, p[5] * m).pvalue > 1e-3
