"""A depth-limited suffix trie with occurrence counts (the index behind SuffixDecoding).

Every suffix of every indexed sequence is stored up to `max_depth` tokens, so a node is an
n-gram (n <= max_depth) and its children are the tokens that followed it, with counts. Appending
a token to a sequence touches at most `max_depth` nodes: the "active" nodes, one per suffix of
the sequence that is still shorter than max_depth.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from specgate.engine.spec_decode.draft_tree import TreeBuilder


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 0

    def append(self, active: list[Node], token: int) -> list[Node]:
        """Extend every suffix in `active` by `token`; return the new active list.

        `active[i]` is the node of the suffix of length i + 1 ending at the previous token.
        """
        new_active: list[Node] = []
        for parent in (self.root, *active[: self.max_depth - 1]):
            child = parent.children.get(token)
            if child is None:
                child = parent.children[token] = Node()
                self.num_nodes += 1
            child.count += 1
            new_active.append(child)
        return new_active

    def add(self, tokens: Sequence[int]) -> list[Node]:
        active: list[Node] = []
        for t in tokens:
            active = self.append(active, t)
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)`: decrement every suffix path and drop nodes that reach zero."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start : start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= self._size(child)
                    del node.children[t]
                    break
                node = child

    def _size(self, node: Node) -> int:
        return 1 + sum(self._size(c) for c in node.children.values())

    def _find(self, pattern: Sequence[int]) -> Node | None:
        node = self.root
        for t in pattern:
            nxt = node.children.get(t)
            if nxt is None:
                return None
            node = nxt
        return node

    def match(self, context: Sequence[int], max_len: int) -> tuple[Node, int] | None:
        """The deepest node for a suffix of `context` (at most max_len tokens) that has a
        continuation, and the suffix's length."""
        longest = min(len(context), self.max_depth, max_len)
        # A suffix that occurs implies all shorter ones occur: binary search the longest present.
        lo, hi = 0, longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._find(context[len(context) - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        for m in range(lo, 0, -1):
            node = self._find(context[len(context) - m :])
            if node is not None and node.children:
                return node, m
        return None


def draft_from(node: Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Follow the most frequent continuation while its estimated probability stays >= min_prob.

    Returns the drafted tokens and their score: the expected number accepted, i.e. the sum of the
    path probabilities.
    """
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / sum(c.count for c in node.children.values())
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score


def draft_tree_from(
    node: Node, chain: Sequence[int], max_depth: int, max_nodes: int, min_prob: float
) -> tuple[list[int], list[int], list[float]]:
    """A draft tree (tokens, parents, scores: each node's share of its parent's continuations) of the
    continuations below `node`: `chain` first (`draft_from(node, max_depth, min_prob)`'s, which the
    caller has), then, best first, the nodes whose estimated path probability is highest and at least
    min_prob (SuffixDecoding's speculation tree), at most max_depth deep and max_nodes large."""
    builder = TreeBuilder(max_nodes)
    builder.add_path(chain)
    tie = itertools.count()
    # Candidates: (-path probability, tie, trie node, parent tree node, token, depth, conditional)
    heap: list[tuple[float, int, Node, int, int, int, float]] = []

    def push(trie: Node, parent: int, prob: float, depth: int) -> None:
        if depth >= max_depth or not trie.children:
            return
        total = sum(c.count for c in trie.children.values())
        for token, child in trie.children.items():
            share = child.count / total
            if prob * share >= min_prob:
                heapq.heappush(heap, (-prob * share, next(tie), child, parent, token, depth + 1, share))

    push(node, -1, 1.0, 0)
    while heap and not builder.full:
        neg, _, trie, parent, token, depth, share = heapq.heappop(heap)
        added = builder.add(parent, token, share)
        if added is not None:
            push(trie, added, -neg, depth)
    return builder.build()
