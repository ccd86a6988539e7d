"""Draft trees: several candidate continuations that share prefixes, verified in one target pass.

A tree is given by its drafted tokens and, per node, the index of its parent node (-1: a child of
the root, the sequence's last committed token). Parents come before their children, and the trees
built here are in depth-first order with each node's best child first, so a tree's first path (the
chain it would have drafted without branches) is nodes 0, 1, ..., d-1. A chain is the tree whose
node i has parent i - 1. Every function here is pure; a node's rank is its place among its siblings.
"""

from __future__ import annotations

from collections.abc import Sequence


def is_valid(parents: Sequence[int]) -> bool:
    """Each parent is -1 or an earlier node."""
    return all(isinstance(p, int) and -1 <= p < i for i, p in enumerate(parents))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def depths(parents: Sequence[int]) -> list[int]:
    """1 for a child of the root, 2 for its children, ..."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ranks(parents: Sequence[int]) -> list[int]:
    """Each node's place among its siblings, 0 for the first (the best) child."""
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Nodes from the root's child down to `node` (empty for the root, node -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def first_path(parents: Sequence[int]) -> list[int]:
    """The chain inside the tree: from the root, always the first child."""
    path: list[int] = []
    at = -1
    for i, p in enumerate(parents):
        if p == at:
            path.append(i)
            at = i
    return path


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node (or -1, the root) -> its children, best first."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def subtree(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """Parents of the tree cut down to the nodes `keep` (ascending, closed under ancestors),
    renumbered in the same order."""
    index = {node: i for i, node in enumerate(keep)}
    return [-1 if parents[n] < 0 else index[parents[n]] for n in keep]


def depth_first(parents: Sequence[int]) -> list[int]:
    """The order that puts each node's subtree right after it, children in their given order (so
    the first path comes first); a permutation of the nodes."""
    kids = children(parents)
    order: list[int] = []
    stack = list(reversed(kids.get(-1, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(kids.get(node, [])))
    return order


def reorder(
    tokens: Sequence[int], parents: Sequence[int], order: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Tokens and parents with the nodes permuted into `order` (parents must stay before children)."""
    index = {node: i for i, node in enumerate(order)}
    return [tokens[n] for n in order], [-1 if parents[n] < 0 else index[parents[n]] for n in order]


class TreeBuilder:
    """Collects (parent, token) nodes in any order that adds parents first; merges a token added
    twice under one parent; `build()` returns them in depth-first order, each node's children in the
    order they were first added (so a proposer adds its best path first). A node may carry the
    proposer's estimate of its conditional probability (that the target picks its token after its
    parent); the goodput controller weighs branches by it."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self._index: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_nodes

    def add(self, parent: int, token: int, prob: float | None = None) -> int | None:
        """The node for `token` under `parent` (-1: the root), added if new; None when full. `prob`
        sets its conditional probability estimate."""
        key = (parent, token)
        node = self._index.get(key)
        if node is None:
            if self.full:
                return None
            node = self._index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.probs.append(0.0)
        if prob is not None:
            self.probs[node] = prob
        return node

    def add_path(self, tokens: Sequence[int], parent: int = -1) -> int:
        """Add a continuation below `parent`, sharing what already exists; nodes added (it stops when
        the tree is full)."""
        added = 0
        for t in tokens:
            before = len(self.tokens)
            node = self.add(parent, int(t))
            if node is None:
                break
            added += len(self.tokens) - before
            parent = node
        return added

    def build(self) -> tuple[list[int], list[int], list[float]]:
        """(tokens, parents, probabilities) in depth-first order."""
        order = depth_first(self.parents)
        tokens, parents = reorder(self.tokens, self.parents, order)
        return tokens, parents, [self.probs[n] for n in order]
