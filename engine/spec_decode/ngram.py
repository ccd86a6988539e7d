"""Prompt lookup: draft what followed the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest, ProposerContext


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Longest n (max_n down to min_n) whose last-n pattern occurred before; what followed it.

    tokens: [L] int array of prompt + output. All windows are compared at once per n.
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Windows of tokens[:-1] start at 0 .. L-1-n, so the pattern's own position is excluded.
        windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            # The most recent occurrence predicts best, unless its continuation runs into the end of
            # the text (in a repeating stretch it always does): then take the latest full-length one.
            available = np.minimum(k, length - hits - n)  # [num_hits]
            start = int(hits[available == available.max()][-1]) + n
            draft: list[int] = tokens[start : start + k].tolist()
            return draft
    return []


class NgramProposer:
    autoregressive = False
    needs_hidden = False

    def __init__(self, ctx: ProposerContext) -> None:
        self.min_n = int(ctx.options.get("min_n", 2))
        self.max_n = int(ctx.options.get("max_n", 4))
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("ngram proposer needs 1 <= min_n <= max_n")

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        pass

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [
            Proposal(ngram_draft(np.asarray(r.token_ids, dtype=np.int64), r.k, self.min_n, self.max_n))
            for r in requests
        ]

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        pass

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        pass
