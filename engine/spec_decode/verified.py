"""One sequence's tokens from one step, as sampling and verification left them: what speculation
settles (speculation.py) and what the output processor appends (output_processor.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgate.engine.outputs import TokenLogprob
from specgate.engine.sequence import Sequence
from specgate.engine.spec_decode.proposer import Proposal
from specgate.engine.vocab import SpecStep


@dataclass(slots=True)
class Verified:
    """A sequence that drafted nothing verified an empty draft: its one sampled token is the bonus
    token. Otherwise its tokens are the accepted drafts, then one recovered or bonus token."""

    seq: Sequence
    proposal: Proposal  # the draft it verified (no tokens: it drafted nothing)
    path: list[int]  # the accepted nodes, root's child first (a chain's: 0 .. accepted - 1)
    token_ids: list[int]  # the accepted drafts' tokens, then one recovered or bonus token
    logprobs: list[TokenLogprob | None]  # per token; None where the request asked for none
    position: int  # the position of the step's first token (its real one; drafts follow)
    # The target's final hidden states over the step's tokens and drafts [len + drafted, hidden],
    # for a proposer that drafts from them; None otherwise.
    hidden: torch.Tensor | None = None
    # The verification step speculation measured (None: nothing drafted, or no speculation): the
    # output processor records it in the request's counters.
    spec_step: SpecStep | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.path) + 1 or len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.path)} accepted nodes emit {len(self.path) + 1} tokens with a logprob slot "
                f"each; got {len(self.token_ids)} tokens and {len(self.logprobs)} logprob slots"
            )
        if len(self.path) > len(self.proposal.token_ids):
            raise ValueError("more nodes accepted than drafted")

    @property
    def num_accepted(self) -> int:
        return len(self.path)
