"""Prompt-lookup (n-gram) drafting: worked examples for `ngram_draft` and the proposer around it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specgate.engine.spec_decode.ngram import NgramProposer, ngram_draft
from tests.engine.spec_decode.helpers import context, request


def draft(tokens: Sequence[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    return ngram_draft(np.asarray(tokens, dtype=np.int64), k, min_n, max_n)


def test_longest_n_is_preferred_over_a_more_recent_shorter_match() -> None:
    # [1, 2, 3] occurred at 0 (followed by 9, 5); [2, 3] alone occurred more recently, followed by 7.
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    assert draft(tokens, k=2, max_n=3) == [9, 5]
    # With n capped at 2 the most recent [2, 3] wins instead.
    assert draft(tokens, k=2, max_n=2) == [7, 1]


def test_most_recent_occurrence_is_preferred() -> None:
    tokens = [1, 2, 5, 1, 2, 6, 0, 0, 1, 2]
    assert draft(tokens, k=3, min_n=2, max_n=2) == [6, 0, 0]


def test_a_recent_occurrence_with_a_short_continuation_loses_to_a_full_length_one() -> None:
    # Occurrences of [1, 2] at 0, 6 and 12; the one at 12 has only 3 tokens before the end.
    tokens = [1, 2, 5, 6, 7, 0, 1, 2, 3, 4, 9, 9, 1, 2, 8, 1, 2]
    # k = 4: the latest occurrence whose continuation is 4 long (at 6) wins over the latest (12).
    assert draft(tokens, k=4, min_n=2, max_n=2) == [3, 4, 9, 9]
    # k = 3: every occurrence has 3 tokens after it, so the most recent one wins.
    assert draft(tokens, k=3, min_n=2, max_n=2) == [8, 1, 2]
    # k = 10: only the occurrence at 0 has 10 tokens after it.
    assert draft(tokens, k=10, min_n=2, max_n=2) == [5, 6, 7, 0, 1, 2, 3, 4, 9, 9]


def test_a_repeating_stretch_drafts_the_full_k() -> None:
    tokens = [1, 2, 1, 2, 1, 2]
    assert draft(tokens, k=4, min_n=2, max_n=2) == [1, 2, 1, 2]
    assert draft(tokens, k=2, min_n=2, max_n=2) == [1, 2]
    # When no occurrence has k tokens after it, the longest continuation available is taken.
    assert draft([7, 7, 7], k=5, min_n=1, max_n=1) == [7, 7]


def test_the_pattern_never_matches_its_own_position() -> None:
    # No token repeats: the last-n pattern exists only at the end, which must not count.
    assert draft([3, 4, 5, 6], k=3, min_n=1, max_n=4) == []
    assert draft([5], k=3) == []
    # The tail [7, 7] only occurs at the end; its shorter suffix [7] occurred once before.
    assert draft([1, 7, 7], k=3, min_n=1, max_n=2) == [7]
    assert draft([1, 7, 7], k=3, min_n=2, max_n=2) == []


def test_k_caps_the_draft() -> None:
    tokens = [4, 5, 6, 7, 8, 9, 10, 11, 4, 5]
    assert draft(tokens, k=1, min_n=2) == [6]
    assert draft(tokens, k=3, min_n=2) == [6, 7, 8]
    assert draft(tokens, k=100, min_n=2) == [6, 7, 8, 9, 10, 11, 4, 5]
    assert draft(tokens, k=0, min_n=2) == []


def test_min_n_is_respected() -> None:
    tokens = [1, 2, 9, 3, 2]
    assert draft(tokens, k=2, min_n=1, max_n=3) == [9, 3]  # [2] matched
    assert draft(tokens, k=2, min_n=2, max_n=3) == []  # no 2-gram repeats


def test_no_match_gives_an_empty_draft() -> None:
    assert draft([10, 11, 12, 13, 14, 15], k=4, min_n=1) == []


def test_sequences_shorter_than_min_n_plus_one_draft_nothing() -> None:
    assert draft([], k=3, min_n=1) == []
    assert draft([2, 2], k=3, min_n=2, max_n=4) == []
    assert draft([2, 2, 2], k=3, min_n=3, max_n=4) == []
    # One token longer is enough for a match of length min_n.
    assert draft([2, 2, 2], k=3, min_n=2, max_n=4) == [2]


def test_proposer_validates_min_n_and_max_n() -> None:
    p = NgramProposer(context())
    assert (p.min_n, p.max_n) == (2, 4)
    p = NgramProposer(context(min_n="1", max_n="3"))
    assert (p.min_n, p.max_n) == (1, 3)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(context(min_n=0))
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(context(min_n=3, max_n=2))


def test_proposer_drafts_each_request_of_a_batch_independently() -> None:
    p = NgramProposer(context(min_n=2, max_n=3))
    reqs = [
        request("a", [1, 2, 3, 4, 5, 1, 2, 3], k=2),
        request("b", [9, 8, 7, 6], k=3),  # nothing repeats
        # The 3-gram [6, 5, 6] wins over the 2-gram [5, 6] though it has only two tokens after it.
        request("c", [5, 6, 5, 6, 5, 6], k=4),
        request("d", [1, 2, 3, 4, 5, 1, 2, 3], k=5),  # same tokens as "a", larger k
        request("e", [3, 1, 3], k=2),  # only a 1-gram repeats: below min_n
    ]
    for r in reqs:
        p.start(r.request_id, r.token_ids)
    proposals = p.propose(reqs)
    assert [x.token_ids for x in proposals] == [[4, 5], [], [5, 6], [4, 5, 1, 2, 3], []]
    assert all(x.probs is None for x in proposals)
    for r in reqs:
        p.commit(r.request_id, r.token_ids, 0)
        p.finish(r.request_id, r.token_ids)
    assert p.propose([]) == []


def test_a_tree_merges_every_matched_continuation_with_the_chain_first() -> None:
    from specgate.engine.spec_decode import draft_tree as dt
    from specgate.engine.spec_decode.ngram import ngram_tree

    # [2, 3] was followed by 7 8, by 9 5 and (most recently) by 7 6: the chain is 7 6.
    tokens = np.asarray([2, 3, 7, 8, 1, 2, 3, 9, 5, 4, 2, 3, 7, 6, 0, 2, 3], dtype=np.int64)
    chain = ngram_draft(tokens, 2, 2, 2)
    assert chain == [7, 6]
    draft, parents, scores = ngram_tree(tokens, 2, 16, 2, 2)
    assert [draft[i] for i in dt.first_path(parents)] == chain
    paths = {tuple(draft[j] for j in dt.path_to(parents, i)) for i in range(len(draft))}
    assert paths == {(7,), (7, 6), (7, 8), (9,), (9, 5)}
    by_path = {tuple(draft[j] for j in dt.path_to(parents, i)): scores[i] for i in range(len(draft))}
    # 7 follows two of the three matches; after 7, 6 and 8 one each.
    assert by_path[(7,)] == 2 / 3 and by_path[(9,)] == 1 / 3
    assert by_path[(7, 6)] == by_path[(7, 8)] == 1 / 2 and by_path[(9, 5)] == 1.0
    # A node budget keeps the chain and what fits after it.
    small, small_parents, _ = ngram_tree(tokens, 2, 3, 2, 2)
    assert len(small) == 3 and [small[i] for i in dt.first_path(small_parents)] == chain


def test_the_proposer_drafts_trees_only_with_a_node_budget_above_k() -> None:
    tokens = [2, 3, 7, 8, 1, 2, 3, 9, 5, 4, 2, 3, 7, 6, 0, 2, 3]
    p = NgramProposer(context(min_n=2, max_n=2))
    req = request("a", tokens, 2)
    assert p.propose([req])[0].parents is None
    req.max_nodes = 8
    tree = p.propose([req])[0]
    assert tree.parents is not None and len(tree.token_ids) == 5 and tree.scores is not None
