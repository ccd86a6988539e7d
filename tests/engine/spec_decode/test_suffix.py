"""The depth-limited suffix trie and the SuffixDecoding-style proposer built on it."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator, Sequence

import pytest

from specgate.engine.spec_decode.suffix import SuffixProposer
from specgate.engine.spec_decode.suffix_tree import Node, SuffixTree, draft_from
from tests.engine.spec_decode.helpers import context, request


def paths(node: Node, prefix: tuple[int, ...] = ()) -> Iterator[tuple[tuple[int, ...], int]]:
    for token, child in node.children.items():
        path = (*prefix, token)
        yield path, child.count
        yield from paths(child, path)


def dump(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """Every node of the tree as {path from the root: count}."""
    return dict(paths(tree.root))


def node_at(tree: SuffixTree, path: Sequence[int]) -> Node:
    node = tree.root
    for t in path:
        node = node.children[t]
    return node


def matched(tree: SuffixTree, ctx: Sequence[int], max_len: int) -> tuple[Node, int]:
    found = tree.match(ctx, max_len)
    assert found is not None
    return found


def fresh(max_depth: int, seqs: Sequence[Sequence[int]]) -> SuffixTree:
    tree = SuffixTree(max_depth)
    for s in seqs:
        tree.add(s)
    return tree


def propose_one(p: SuffixProposer, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
    (proposal,) = p.propose([request(request_id, tokens, k)])
    assert proposal.probs is None
    return proposal.token_ids


# ---- SuffixTree -------------------------------------------------------------------------------


def test_add_counts_every_suffix_path_up_to_max_depth() -> None:
    tree = SuffixTree(3)
    active = tree.add([1, 2, 1, 2])
    # Substrings of length <= 3 by start: 0: 1, 12, 121; 1: 2, 21, 212; 2: 1, 12; 3: 2.
    assert dump(tree) == {(1,): 2, (1, 2): 2, (1, 2, 1): 1, (2,): 2, (2, 1): 1, (2, 1, 2): 1}
    assert tree.num_nodes == 6
    # The active nodes are the suffixes ending at the last token, shortest first.
    assert active == [node_at(tree, [2]), node_at(tree, [1, 2]), node_at(tree, [2, 1, 2])]


def test_max_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(0)


def test_append_with_active_nodes_equals_add() -> None:
    rng = random.Random(0)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    added = fresh(4, seqs)
    appended = SuffixTree(4)
    for s in seqs:
        active: list[Node] = []
        for t in s:
            active = appended.append(active, t)
            assert len(active) <= 4
    assert dump(appended) == dump(added)
    assert appended.num_nodes == added.num_nodes == len(dump(added))


def test_no_node_is_deeper_than_max_depth() -> None:
    tree = SuffixTree(5)
    tree.add(list(range(40)))
    depths = [len(path) for path in dump(tree)]
    assert max(depths) == 5
    # 40 distinct tokens: one path per start, each min(5, 40 - start) long.
    assert tree.num_nodes == sum(min(5, 40 - s) for s in range(40))


def test_remove_undoes_add_with_shared_prefixes() -> None:
    a = [1, 2, 3, 1, 2, 4]
    b = [1, 2, 3, 5, 1, 2]
    tree = fresh(3, [a])
    only_a = dump(tree)
    tree.add(b)
    assert tree.num_nodes > len(only_a)
    tree.remove(b)
    assert dump(tree) == only_a and tree.num_nodes == len(only_a)
    tree.add(b)
    tree.remove(a)
    assert dump(tree) == dump(fresh(3, [b])) and tree.num_nodes == len(dump(fresh(3, [b])))
    tree.remove(b)
    assert tree.num_nodes == 0 and tree.root.children == {}


def test_remove_in_any_order_matches_a_tree_of_the_remaining_sequences() -> None:
    rng = random.Random(1)
    seqs = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 25))) for _ in range(12)]
    seqs.append(seqs[0])  # the same sequence twice
    tree = fresh(6, seqs)
    remaining = list(seqs)
    rng.shuffle(remaining)
    while remaining:
        tree.remove(remaining.pop())
        expected = fresh(6, remaining)
        assert dump(tree) == dump(expected)
        assert tree.num_nodes == expected.num_nodes == len(dump(expected))
    assert tree.num_nodes == 0


def test_match_returns_the_deepest_suffix_with_a_continuation() -> None:
    tree = fresh(8, [[1, 2, 3, 4, 9, 2, 3, 5]])
    node, length = matched(tree, [7, 2, 3], max_len=8)
    assert length == 2 and node is node_at(tree, [2, 3])
    assert set(node.children) == {4, 5}
    node, length = matched(tree, [1, 2, 3], max_len=8)
    assert length == 3 and node is node_at(tree, [1, 2, 3])
    # max_len caps the suffix length.
    node, length = matched(tree, [1, 2, 3], max_len=2)
    assert length == 2 and node is node_at(tree, [2, 3])
    assert tree.match([6, 7], max_len=8) is None  # no suffix occurs
    assert tree.match([], max_len=8) is None


def test_match_skips_suffixes_that_only_occur_at_an_end() -> None:
    tree = fresh(8, [[1, 2, 3], [2, 3, 4]])
    # [1, 2, 3] occurs but nothing followed it; [2, 3] was followed by 4.
    node, length = matched(tree, [1, 2, 3], max_len=8)
    assert length == 2 and list(node.children) == [4]
    assert fresh(8, [[1, 2, 3]]).match([1, 2, 3], max_len=8) is None


def test_match_is_limited_by_max_depth() -> None:
    tree = fresh(3, [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6]])
    node, length = matched(tree, [1, 2, 3, 4], max_len=10)
    # [1, 2, 3, 4] is deeper than the tree; [3, 4] is the longest suffix with a child at depth <= 3.
    assert length == 2 and set(node.children) == {5, 6}


def test_draft_from_follows_the_most_frequent_child_and_stops_under_min_prob() -> None:
    tree = fresh(4, [[5, 1, 2], [5, 1, 2], [5, 1, 3], [5, 6]])
    node = node_at(tree, [5])
    assert {t: c.count for t, c in node.children.items()} == {1: 3, 6: 1}
    # P(1 | 5) = 3/4; P(2 | 5 1) = 2/3, so the path probability of [1, 2] is 1/2.
    tokens, score = draft_from(node, 10, 0.0)
    assert tokens == [1, 2] and score == pytest.approx(0.75 + 0.5)
    tokens, score = draft_from(node, 10, 0.5)  # 0.5 is not below min_prob
    assert tokens == [1, 2] and score == pytest.approx(1.25)
    tokens, score = draft_from(node, 10, 0.6)
    assert tokens == [1] and score == pytest.approx(0.75)
    tokens, score = draft_from(node, 1, 0.0)
    assert tokens == [1] and score == pytest.approx(0.75)
    assert draft_from(node, 0, 0.0) == ([], 0.0)
    assert draft_from(node, 10, 0.8) == ([], 0.0)
    assert draft_from(node_at(tree, [6]), 10, 0.0) == ([], 0.0)  # a leaf


# ---- SuffixProposer ---------------------------------------------------------------------------


def test_request_tree_finds_repeats_within_the_prompt() -> None:
    p = SuffixProposer(context())
    prompt = [10, 11, 12, 13, 14, 20, 21, 22, 23, 10, 11, 12]
    p.start("r", prompt)
    assert propose_one(p, "r", prompt, k=3) == [13, 14, 20]
    # Match length 3 and the default max_spec_factor 2 allow 6 tokens.
    assert propose_one(p, "r", prompt, k=8) == [13, 14, 20, 21, 22, 23]
    # Committed output is indexed too: the match grows to [10, 11, 12, 13].
    out = [*prompt, 13]
    p.commit("r", out, 1)
    assert propose_one(p, "r", out, k=2) == [14, 20]
    # propose indexes tokens it has not seen even without a commit.
    out = [*out, 14, 20]
    assert propose_one(p, "r", out, k=3) == [21, 22, 23]


def test_the_request_tree_indexes_only_the_prompt_tail() -> None:
    p = SuffixProposer(context(max_prompt_tokens=6))
    prompt = [1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 1, 2]
    p.start("r", prompt)
    assert propose_one(p, "r", prompt, k=3) == []  # the earlier [1, 2] lies outside the tail
    # Output is indexed as usual and continues the tail's suffixes.
    out = [*prompt, 45, 46]
    assert propose_one(p, "r", out, k=3) == [1, 2, 45]


def test_nothing_to_draft_without_a_repeat() -> None:
    p = SuffixProposer(context())
    p.start("r", [1, 2, 3, 4])
    assert propose_one(p, "r", [1, 2, 3, 4], k=4) == []
    assert propose_one(p, "unknown", [1, 2, 3, 4], k=4) == []


def test_finished_requests_feed_the_global_cache() -> None:
    p = SuffixProposer(context())
    a_prompt = [1, 2, 3, 40, 41, 42, 43, 44, 45]
    b_prompt = [7, 8, 9, 40, 41, 42]
    p.start("a", a_prompt)
    p.start("b", b_prompt)
    assert propose_one(p, "b", b_prompt, k=5) == []  # "a" has not finished yet
    p.finish("a", [*a_prompt, 50, 51])
    assert p.cached_tokens == len(a_prompt) + 2
    # "b" shares the phrase [40, 41, 42] with "a": the shared cache drafts what followed it.
    assert propose_one(p, "b", b_prompt, k=5) == [43, 44, 45, 50, 51]
    p.finish("b", b_prompt)
    assert p.cached_tokens == len(a_prompt) + 2 + len(b_prompt)
    p.finish("b", b_prompt)  # a second finish is a no-op
    assert p.cached_tokens == len(a_prompt) + 2 + len(b_prompt)


def test_scopes_keep_tenants_apart_within_one_budget() -> None:
    p = SuffixProposer(context(max_depth=4, max_cached_tokens=12))
    shared = [40, 41, 42]
    p.start("a", shared, scope="tenant-a")
    p.finish("a", [*shared, 50, 51])  # tenant a's output
    p.start("b", shared, scope="tenant-b")
    assert propose_one(p, "b", shared, k=2) == []  # tenant b never drafts from a's output
    p.start("a2", shared, scope="tenant-a")
    assert propose_one(p, "a2", shared, k=2) == [50, 51]  # a's next request does
    p.start("anon", shared, scope=None)
    assert propose_one(p, "anon", shared, k=2) == []  # scope None reads nothing
    p.finish("anon", [*shared, 60, 61])
    assert p.cached_tokens == 5 and p.scopes == ["tenant-a"]  # ... and feeds nothing
    p.finish("b", [*shared, 70, 71, 72, 73])  # 7 more tokens: 12 in all, within the budget
    assert sorted(p.scopes) == ["tenant-a", "tenant-b"]
    p.finish("a2", [*shared, 50, 51])  # 17 > 12: the oldest sequence (a's first) goes, from its scope
    assert p.cached_tokens == 12 and sorted(p.scopes) == ["tenant-a", "tenant-b"]
    p.start("a3", shared, scope="tenant-a")
    assert propose_one(p, "a3", shared, k=2) == [50, 51]


def test_the_candidate_with_the_higher_score_wins() -> None:
    p = SuffixProposer(context())
    prompt = [1, 2, 9, 1, 2]
    p.start("r", prompt)
    assert propose_one(p, "r", prompt, k=4) == [9, 1, 2]  # local: score 3
    p.cache([1, 2, 7, 7, 7, 7])
    assert propose_one(p, "r", prompt, k=4) == [7, 7, 7, 7]  # global: score 4
    assert propose_one(p, "r", prompt, k=3) == [9, 1, 2]  # a tie keeps the request's own tree


def test_the_global_cache_stays_within_max_cached_tokens() -> None:
    p = SuffixProposer(context(max_depth=4, max_cached_tokens=10))
    s1, s2, s3 = [1, 2, 3, 4], [11, 12, 13, 14], [21, 22, 23]
    p.cache(s1)
    p.cache(s2)
    assert p.cached_tokens == 8
    assert p.shared_tree().num_nodes == fresh(4, [s1, s2]).num_nodes == 20
    assert propose_one(p, "x", [0, 1, 2], k=2) == [3, 4]
    p.cache(s3)  # 11 tokens > 10: the oldest sequence goes
    assert p.cached_tokens == 7
    assert dump(p.shared_tree()) == dump(fresh(4, [s2, s3]))
    assert p.shared_tree().num_nodes == 16
    assert propose_one(p, "x", [0, 1, 2], k=2) == []
    assert propose_one(p, "x", [0, 21, 22], k=2) == [23]
    assert propose_one(p, "x", [0, 11, 12], k=2) == [13, 14]


def test_finish_caches_at_most_max_cached_tokens_of_a_long_request() -> None:
    p = SuffixProposer(context(max_depth=4, max_cached_tokens=10))
    tokens = list(range(30, 45))  # 15 tokens
    p.start("r", tokens[:5])
    p.finish("r", tokens)
    assert p.cached_tokens == 10
    assert dump(p.shared_tree()) == dump(fresh(4, [tokens[5:]]))
    assert propose_one(p, "x", [31, 32], k=2) == []  # the evicted head
    assert propose_one(p, "x", [41, 42], k=2) == [43, 44]


def test_concurrent_cache_and_propose_leave_a_consistent_tree() -> None:
    p = SuffixProposer(context(max_depth=6, max_cached_tokens=400))
    prompt = [1, 2, 3, 1, 2]
    p.start("main", prompt)
    errors: list[BaseException] = []

    def feed(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                p.cache([rng.randrange(6) for _ in range(rng.randrange(1, 20))])
        except BaseException as e:  # surfaced below
            errors.append(e)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often to provoke interleavings
    try:
        threads = [threading.Thread(target=feed, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        num_proposals = 0
        while any(t.is_alive() for t in threads):
            for d in p.propose([request("main", prompt, k=4), request("other", [4, 5], k=4)]):
                assert len(d.token_ids) <= 4
            num_proposals += 1
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    assert num_proposals > 0  # the main thread really read the cache while it was being fed
    cached = [seq for _, seq in p._cached]
    tree = p.shared_tree()
    assert tree is not None
    assert p.cached_tokens == sum(map(len, cached)) <= 400
    assert dump(tree) == dump(fresh(6, cached))
    assert tree.num_nodes == len(dump(tree))
    for seq in cached:
        tree.remove(seq)
    assert tree.num_nodes == 0 and tree.root.children == {}


@pytest.mark.parametrize(
    ("factor", "by_context"),
    [
        (1.0, {(50, 3): [4], (50, 2, 3): [4, 5], (1, 2, 3): [4, 5, 6]}),
        (2.0, {(50, 3): [4, 5], (50, 2, 3): [4, 5, 6, 7], (1, 2, 3): [4, 5, 6, 7, 8, 9]}),
        (0.5, {(50, 3): [4], (50, 2, 3): [4], (1, 2, 3): [4, 5]}),
    ],
)
def test_draft_length_grows_with_the_match_length(factor: float, by_context: dict) -> None:
    p = SuffixProposer(context(max_spec_factor=factor))
    p.cache([1, 2, 3, 4, 5, 6, 7, 8, 9])
    for ctx, expected in by_context.items():
        assert propose_one(p, "x", ctx, k=8) == expected
    # k still caps the draft.
    assert propose_one(p, "x", [1, 2, 3], k=1) == [4]


def test_a_speculation_tree_keeps_the_likeliest_continuations() -> None:
    from specgate.engine.spec_decode import draft_tree as dt
    from specgate.engine.spec_decode.suffix_tree import draft_tree_from

    tree = SuffixTree(8)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [1, 9]):
        tree.add(seq)
    node = tree.root.children[1]  # after 1: 2 (4 of 5), 9 (1 of 5)
    chain, _ = draft_from(node, 3, 0.1)
    tokens, parents, scores = draft_tree_from(node, chain, 3, 16, 0.1)
    assert [tokens[i] for i in dt.first_path(parents)] == chain == [2, 3, 4]
    got = {tuple(tokens[j] for j in dt.path_to(parents, i)): round(scores[i], 3) for i in range(len(tokens))}
    # Path probabilities: 2 .8, 2 3 .6, 2 3 4 .4, 2 6 .2, 2 3 5 .2, 9 .2, 2 6 7 .2; all >= 0.1.
    assert got == {
        (2,): 0.8,
        (2, 3): 0.75,
        (2, 3, 4): 0.667,
        (2, 3, 5): 0.333,
        (2, 6): 0.25,
        (2, 6, 7): 1.0,
        (9,): 0.2,
    }
    # A budget of 5: the chain, then the best two others by path probability (ties in push order).
    tokens, parents, _ = draft_tree_from(node, chain, 3, 5, 0.1)
    assert len(tokens) == 5 and [tokens[i] for i in dt.first_path(parents)] == [2, 3, 4]
    # A minimum probability of 0.3 keeps the chain (its nodes are >= 0.4) and nothing else.
    tokens, parents, _ = draft_tree_from(node, draft_from(node, 3, 0.3)[0], 3, 16, 0.3)
    assert tokens == [2, 3, 4] and dt.is_chain(parents)
