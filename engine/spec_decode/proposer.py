"""The one Proposer protocol every drafting method implements (the table of them: proposers.py).

The engine never dispatches on a proposer's type or name beyond a table lookup: it asks the
proposer for drafts, tells it what was committed, and when a request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specgate.engine.sampler import SamplingRow, draw
from specgate.engine.structured_output.constraint import Constraint


@dataclass(slots=True)
class ProposalRequest:
    request_id: str
    token_ids: Sequence[int]  # prompt + committed output
    num_prompt_tokens: int
    k: int  # draft at most this many tokens (a tree: at most this deep)
    row: SamplingRow  # sampling state, for proposers that sample from a distribution
    # A proposer that drafts trees may return up to this many nodes (it must return a chain when it
    # is at most k); one that drafts chains ignores it.
    max_nodes: int = 0
    # The request's grammar state: a proposer that samples drafts from a distribution draws them
    # under its mask (draft_row), so q is the law the token came from. None: unconstrained.
    constraint: Constraint | None = None
    # Tokens the engine verifies ahead of this draft (a grammar's forced tokens): a proposer whose
    # `drafts_past_extra` is true drafts after token_ids + extra; others draft after token_ids.
    extra: Sequence[int] = ()


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    # Draft distributions [len(token_ids), vocab] after the request's logits processing, or None
    # for a deterministic proposer (a point mass on each drafted token). In a tree, row i is the
    # law node i's token was drawn from given its siblings before it.
    probs: torch.Tensor | None = None
    # A draft tree (engine/spec_decode/draft_tree.py): per node its parent node, -1 for a child of
    # the root, in depth-first order with each node's best child first. None: a chain.
    parents: list[int] | None = None
    # Per node of a tree, the proposer's estimate that the target picks its token after its parent
    # (a draft probability, a continuation's frequency); None: no estimate.
    scores: list[float] | None = None
    # Leading nodes of the first path that the grammar forced (engine/structured_output/constraint.py):
    # point masses that cost no proposer time, verified like any draft.
    num_forced: int = 0


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need from the engine that builds it."""

    vocab_size: int
    device: torch.device
    dtype: str
    tokenizer: Any
    options: dict[str, Any]  # EngineConfig.proposer_options[name]
    runner: Any = None  # the target's ModelRunner: its embeddings, LM head and hidden size (EAGLE)
    model_name: str = ""  # the target's name, for proposers that ship weights per target


class Proposer(Protocol):
    # True when each drafted token costs one more sequential step (a draft model, an EAGLE head);
    # False when a draft of any length costs one lookup (n-gram, suffix index).
    autoregressive: bool
    # True when the proposer drafts from the target's hidden states (EAGLE): the engine then returns
    # them from the target pass and hands over those of verified positions via `observe_hidden`.
    needs_hidden: bool
    # True when the proposer can draft after `ProposalRequest.extra` (tokens not yet committed, which
    # it must not learn from): a lookup in the context. Model proposers have no state for them.
    drafts_past_extra: bool

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        """A request that will use this proposer was admitted with these prompt tokens. State kept
        across requests (a suffix cache) is shared only among requests of the same `scope`; a
        request with scope None neither reads nor feeds it."""

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        """Draft up to `k` tokens for each request (fewer, or none, is fine); a proposer that drafts
        trees may return up to `max_nodes` nodes, at most `k` deep."""
        ...

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [n, hidden_size] at positions start .. start + n - 1, all
        of them verified (only called when `needs_hidden`)."""

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        """The last `num_new` of `token_ids` were committed (verified) for the request."""

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request ended; release its state (a proposer may keep what it learned)."""


def draft_row(r: ProposalRequest, drafts: Sequence[int]) -> SamplingRow:
    """The request's sampling state after its first `drafts`, for scoring the next draft position."""
    base = r.row
    allowed = r.constraint.allowed_after(drafts) if r.constraint is not None else base.allowed
    return SamplingRow(
        base.params,
        [*r.token_ids, *drafts],
        base.num_prompt_tokens,
        base.generator,
        base.suppress_token_ids,
        allowed,
    )


def draw_draft(processed: torch.Tensor, row: SamplingRow) -> tuple[int, torch.Tensor | None]:
    """A draft token from processed logits [vocab]: the argmax for a greedy request (a point mass, no
    distribution), else a sample and the distribution q it came from, which verification needs."""
    if row.params.greedy:
        return int(processed.argmax()), None
    q = processed.softmax(dim=-1)
    return draw(q, row.generator), q


ProposerFactory = Callable[[ProposerContext], Proposer]
