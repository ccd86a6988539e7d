"""Prompt lookup: draft what followed the most recent earlier occurrence of the last n tokens.

With a node budget it drafts a tree instead: the chain first, then what followed other earlier
occurrences (of the longest n first, the most recent first), merged where they share a prefix. At a
node, a continuation seen more often comes before one seen less (SGLang's n-gram proposer verifies
such trees of matches too)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specgate.engine.spec_decode.draft_tree import TreeBuilder
from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest, ProposerContext


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n (max_n down to min_n) whose last-n pattern occurred before; what followed it.

    tokens: [L] int array of prompt + output. All windows are compared at once per n.
    """
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        hits = _matches(tokens, n)
        if len(hits):
            return _chain(tokens, hits, n, k)
    return []


def _matches(tokens: np.ndarray, n: int) -> np.ndarray:
    """Start positions of the earlier occurrences of the last n tokens."""
    # Windows of tokens[:-1] start at 0 .. L-1-n, so the pattern's own position is excluded.
    windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]
    return np.flatnonzero((windows == tokens[len(tokens) - n :]).all(axis=1))


def _chain(tokens: np.ndarray, hits: np.ndarray, n: int, k: int) -> list[int]:
    """What followed the best of `hits` (occurrences of the last n tokens), at most k tokens."""
    # The most recent occurrence predicts best, unless its continuation runs into the end of the text
    # (in a repeating stretch it always does): then take the latest full-length one.
    available = np.minimum(k, len(tokens) - hits - n)  # [num_hits]
    start = int(hits[available == available.max()][-1]) + n
    draft: list[int] = tokens[start : start + k].tolist()
    return draft


# Occurrences looked at per n when drafting a tree (the most recent ones).
MAX_TREE_MATCHES = 32


def ngram_tree(
    tokens: np.ndarray, k: int, max_nodes: int, min_n: int, max_n: int
) -> tuple[list[int], list[int], list[float]]:
    """A draft tree (tokens, parents, scores) at most k deep and max_nodes large; its first path is
    `ngram_draft`'s chain. A node's score: the share of the matched occurrences through its parent
    that continue with its token."""
    chain: list[int] = []
    counts: dict[tuple[int, ...], int] = {}  # continuation prefixes -> occurrences
    paths: list[list[int]] = []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        hits = _matches(tokens, n)
        if len(hits) and not chain:  # the longest n that matches gives the chain, as in ngram_draft
            chain = _chain(tokens, hits, n, k)
        for h in hits[-MAX_TREE_MATCHES:][::-1]:
            cont = tokens[h + n : h + n + k].tolist()
            if cont:
                paths.append(cont)
                for j in range(1, len(cont) + 1):
                    counts[tuple(cont[:j])] = counts.get(tuple(cont[:j]), 0) + 1
    if not chain:
        return [], [], []
    builder = TreeBuilder(max_nodes)
    builder.add_path(chain)
    # Branch off where the most frequent continuations part from what is already in the tree.
    for cont in sorted(paths, key=lambda c: [-counts[tuple(c[:j])] for j in range(1, len(c) + 1)]):
        if builder.full:
            break
        builder.add_path(cont)
    draft, parents, _ = builder.build()
    prefix: list[tuple[int, ...]] = []  # each node's path from the root
    for token, p in zip(draft, parents, strict=True):
        prefix.append((*(prefix[p] if p >= 0 else ()), token))
    through = [counts.get(path, 0) for path in prefix]  # occurrences continuing through each node
    scores = [through[i] / (len(paths) if p < 0 else max(1, through[p])) for i, p in enumerate(parents)]
    return draft, parents, scores


class NgramProposer:
    autoregressive = False
    needs_hidden = False
    drafts_past_extra = True

    def __init__(self, ctx: ProposerContext) -> None:
        self.min_n = int(ctx.options.get("min_n", 2))
        self.max_n = int(ctx.options.get("max_n", 4))
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("ngram proposer needs 1 <= min_n <= max_n")

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        pass

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            tokens = np.asarray([*r.token_ids, *r.extra] if r.extra else r.token_ids, dtype=np.int64)
            if r.max_nodes > r.k:
                draft, parents, scores = ngram_tree(tokens, r.k, r.max_nodes, self.min_n, self.max_n)
                out.append(Proposal(draft, None, parents, scores))
            else:
                out.append(Proposal(ngram_draft(tokens, r.k, self.min_n, self.max_n)))
        return out

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        pass

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass
