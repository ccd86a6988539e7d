"""Draft trees: the pure helpers and the builder proposers use."""

from __future__ import annotations

import torch

from specgate.engine.batch_layout import ancestor_mask
from specgate.engine.spec_decode import draft_tree as dt

# The tree used below (root r):      r
#                                  /   \
#                                 0(a)  3(d)
#                                /  \     \
#                              1(b) 2(c)  4(e)
PARENTS = [-1, 0, 0, -1, 3]


def test_depths_ranks_paths() -> None:
    assert dt.depths(PARENTS) == [1, 2, 2, 1, 2]
    assert dt.ranks(PARENTS) == [0, 0, 1, 1, 0]
    assert dt.path_to(PARENTS, 4) == [3, 4]
    assert dt.path_to(PARENTS, -1) == []
    assert dt.first_path(PARENTS) == [0, 1]
    assert dt.children(PARENTS) == {-1: [0, 3], 0: [1, 2], 3: [4]}


def test_validity_and_chains() -> None:
    assert dt.is_valid(PARENTS)
    assert not dt.is_valid([0])  # its own parent
    assert not dt.is_valid([-1, 2, 0])  # a parent after the child
    assert not dt.is_valid([-2])
    assert dt.is_chain(dt.chain_parents(4)) and dt.first_path(dt.chain_parents(4)) == [0, 1, 2, 3]
    assert not dt.is_chain(PARENTS)


def test_subtree_renumbers() -> None:
    assert dt.subtree(PARENTS, [0, 2, 3]) == [-1, 0, -1]


def test_ancestor_mask_sees_the_root_its_ancestors_and_itself() -> None:
    mask = ancestor_mask(PARENTS)  # rows and columns: root, then nodes 0..4
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_builder_merges_shared_prefixes_in_depth_first_order() -> None:
    b = dt.TreeBuilder(max_nodes=10)
    assert b.add_path([5, 6, 7]) == 3
    assert b.add_path([8, 9]) == 2  # a second child of the root, added after the first path
    assert b.add_path([5, 6, 1]) == 1  # shares 5, 6
    tokens, parents, _ = b.build()
    # Depth first: the first path, then 5 -> 6 -> 1, then the root's second child.
    assert tokens == [5, 6, 7, 1, 8, 9]
    assert parents == [-1, 0, 1, 1, -1, 4]
    assert dt.first_path(parents) == [0, 1, 2]


def test_builder_stops_at_its_budget() -> None:
    b = dt.TreeBuilder(max_nodes=3)
    b.add_path([1, 2])
    assert b.add_path([3, 4]) == 1 and b.full
    assert b.add(-1, 9) is None
    assert b.add(-1, 1) == 0  # an existing node is still found
    assert b.build()[:2] == ([1, 2, 3], [-1, 0, -1])


def test_depth_first_keeps_parents_first() -> None:
    parents = [-1, -1, 0, 1, 2]
    order = dt.depth_first(parents)
    assert order == [0, 2, 4, 1, 3]
    tokens, reordered = dt.reorder([10, 11, 12, 13, 14], parents, order)
    assert tokens == [10, 12, 14, 11, 13] and dt.is_valid(reordered)
