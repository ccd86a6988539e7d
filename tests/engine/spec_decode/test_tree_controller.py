"""The goodput controller on trees: branch gains from ranks or calibrated proposer scores, and
branches kept only while one more token raises expected goodput."""

from __future__ import annotations

from specgate.engine.spec_decode.controller import (
    ACCEPTANCE_EWMA,
    BRANCH_PRIOR,
    SpecState,
    TreeCandidate,
    grow_trees,
)
from specgate.engine.vocab import SpecParams
from tests.engine.spec_decode.test_controller import FixedCosts

# Root children 0 (first path 0 -> 1 -> 2) and 3 (-> 4); node 0 has a second child 5.
PARENTS = [-1, 0, 1, -1, 3, 0]


def state(prior: float = 0.6) -> SpecState:
    return SpecState(SpecParams(method="ngram", acceptance_prior=prior))


def test_a_walk_updates_first_child_and_branch_rates() -> None:
    s = state()
    # Root: 2 children, the second taken; then node 3: 1 child, none taken.
    s.observe_walk([(2, 1, None), (1, None, None)])
    assert s.alpha[0] == 0.6 + ACCEPTANCE_EWMA * (0.0 - 0.6)
    assert s.branch[0] == BRANCH_PRIOR + ACCEPTANCE_EWMA * (1.0 - BRANCH_PRIOR)
    assert s.alpha[1] == 0.6 + ACCEPTANCE_EWMA * (0.0 - 0.6)
    before = list(s.branch)
    s.observe_walk([(1, 0, None)])  # a chain step: no branch was there to learn from
    assert s.branch == before


def test_scores_are_calibrated_by_what_was_accepted() -> None:
    s = state()
    assert s.scored(0.3) == 0.3
    for _ in range(60):  # children summing to 0.8 at each visit, none ever accepted
        s.observe_walk([(2, None, 0.8)])
    assert s.scored(0.3) < 0.1
    t = state()
    for _ in range(60):  # children summing to 0.2, one always accepted: scores undersell
        t.observe_walk([(2, 0, 0.2)])
    assert t.scored(0.2) > 0.7 and t.scored(0.9) == 1.0


def test_cheap_tokens_grow_branches_dear_tokens_keep_the_chain() -> None:
    cheap = FixedCosts(lambda n: 1.0 + 0.001 * n)
    dear = FixedCosts(lambda n: float(n))
    c = TreeCandidate(state(), PARENTS, cap=16)
    assert grow_trees([c], 1, 4, 64, cheap) == [[0, 1, 2, 3, 4, 5]]
    assert grow_trees([c], 1, 4, 64, dear) == [[0, 1, 2]]


def test_branches_go_best_gain_first_within_budget_and_cap() -> None:
    costs = FixedCosts(lambda n: 1.0 + 0.001 * n)
    # Node 5 (a second child under the accepted-first node 0) scores high, node 3 low: by scores,
    # node 5 comes before node 3, and node 4 needs node 3 first.
    scores = [0.9, 0.9, 0.9, 0.05, 0.9, 0.5]
    c = TreeCandidate(state(), PARENTS, cap=16, scores=scores)
    assert grow_trees([c], 1, 4, 1, costs) == [[0, 1, 2, 5]]
    assert grow_trees([c], 1, 4, 2, costs) == [[0, 1, 2, 3, 5]]
    capped = TreeCandidate(state(), PARENTS, cap=4, scores=scores)
    assert grow_trees([capped], 1, 4, 64, costs) == [[0, 1, 2, 5]]


def test_a_branch_must_beat_the_goodput_it_dilutes() -> None:
    """With 3% per extra token, a branch of gain g pays in a step expecting E tokens only if
    (E + g) / E > 1.03: a low-scored branch is dropped, a high-scored one kept."""
    costs = FixedCosts(lambda n: 1.0 + 0.03 * (n - 1))
    low = TreeCandidate(state(), [-1, -1], cap=4, scores=[0.9, 0.02])
    high = TreeCandidate(state(), [-1, -1], cap=4, scores=[0.5, 0.4])
    assert grow_trees([low], 1, 2, 8, costs) == [[0]]
    assert grow_trees([high], 1, 2, 8, costs) == [[0, 1]]


def test_a_batch_shares_one_budget_best_gain_first() -> None:
    costs = FixedCosts(lambda n: 1.0 + 0.001 * n)
    a = TreeCandidate(state(), [-1, -1], cap=4, scores=[0.5, 0.1])
    b = TreeCandidate(state(), [-1, -1], cap=4, scores=[0.5, 0.4])
    assert grow_trees([a, b], 2, 4, 1, costs) == [[0], [0, 1]]
