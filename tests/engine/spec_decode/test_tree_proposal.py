"""Checking and cutting proposals, chains and trees, and the histories and walks around verification."""

from __future__ import annotations

import torch

from specgate.engine.spec_decode import tree_proposal as tp
from specgate.engine.spec_decode.proposer import Proposal
from tests.engine.spec_decode.helpers import request

# Root children a (0) and d (3); a -> b (1) -> c (2); d -> e (4).
TOKENS = [10, 11, 12, 13, 14]
PARENTS = [-1, 0, 1, -1, 3]


def req(k: int, max_nodes: int):  # type: ignore[no-untyped-def]
    r = request("r", [1, 2, 3], k)
    r.max_nodes = max_nodes
    return r


def test_a_chain_is_cut_to_k() -> None:
    out, problem = tp.checked(Proposal([5, 6, 7], torch.eye(96)[:3]), req(2, 0), 96)
    assert problem is None and out is not None
    assert out.token_ids == [5, 6] and out.parents is None and out.probs is not None
    assert out.probs.shape == (2, 96)


def test_a_tree_is_cut_by_depth_and_node_budget() -> None:
    scores = [0.5, 0.4, 0.3, 0.2, 0.1]
    out, _ = tp.checked(Proposal(TOKENS, None, PARENTS, scores), req(2, 16), 96)
    assert out is not None and out.token_ids == [10, 11, 13, 14] and out.parents == [-1, 0, -1, 2]
    assert out.scores == [0.5, 0.4, 0.2, 0.1]
    out, _ = tp.checked(Proposal(TOKENS, None, PARENTS), req(3, 4), 96)
    assert out is not None and out.token_ids == [10, 11, 12, 13] and out.parents == [-1, 0, 1, -1]
    # With no budget above k, a tree proposal is verified as its chain.
    out, _ = tp.checked(Proposal(TOKENS, None, PARENTS), req(3, 3 - 1), 96)
    assert out is not None and out.token_ids == [10, 11, 12] and out.parents is None


def test_what_cannot_be_verified_is_dropped_with_a_reason() -> None:
    assert tp.checked(Proposal([5, 96]), req(2, 0), 96) == (None, "tokens outside the vocabulary")
    assert tp.checked(Proposal(TOKENS, None, [-1, 2, 0, -1, 3]), req(3, 8), 96)[1] == "a malformed tree"
    assert tp.checked(Proposal(TOKENS, None, PARENTS[:4]), req(3, 8), 96)[1] == "a malformed tree"
    out, problem = tp.checked(Proposal([5, 6], torch.ones(1, 96)), req(2, 0), 96)
    assert out is None and problem is not None and "shape" in problem
    # Bad scores cost only the scores.
    for bad in ([float("nan")] * 5, [1.5] * 5, [0.1] * 4):
        out, problem = tp.checked(Proposal(TOKENS, None, PARENTS, bad), req(3, 8), 96)
        assert problem is None and out is not None and out.parents is not None and out.scores is None
    assert tp.checked(Proposal([]), req(2, 0), 96) == (None, None)


def test_cut_and_first_path() -> None:
    tree = Proposal(TOKENS, None, PARENTS, [0.5, 0.4, 0.3, 0.2, 0.1])
    cut = tp.cut(tree, [0, 3, 4])
    assert cut.token_ids == [10, 13, 14] and cut.parents == [-1, -1, 1] and cut.scores == [0.5, 0.2, 0.1]
    chain = tp.first_path(tree)
    assert chain.token_ids == [10, 11, 12] and chain.parents is None and chain.scores is None


def test_histories_and_walks() -> None:
    tree = Proposal(TOKENS, None, PARENTS, [0.5, 0.4, 0.3, 0.2, 0.1])
    assert tp.histories(tree) == [[], [10], [10, 11], [10, 11, 12], [13], [13, 14]]
    assert tp.histories(Proposal([7, 8])) == [[], [7], [7, 8]]
    # Accepted d then e: at the root (2 children, scores 0.5 + 0.2) rank 1, at d (1 child) rank 0,
    # then e is a leaf: nothing more to learn.
    assert tp.walk(PARENTS, [3, 4], tree.scores) == [(2, 1, 0.7), (1, 0, 0.1)]
    assert tp.walk(PARENTS, [0], None) == [(2, 0, None), (1, None, None)]
    assert tp.walk(PARENTS, [], None) == [(2, None, None)]
