"""A request's state inside the engine: its tokens, KV blocks, sampling state and counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specgate.engine.constraint import Constraint
from specgate.engine.detokenizer import IncrementalDetokenizer
from specgate.engine.outputs import RequestStats, TokenLogprob
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.controller import SpecState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    # Prompt followed by every generated token; the first `num_prompt_tokens` are the prompt.
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    stats: RequestStats
    detokenizer: IncrementalDetokenizer | None = None
    spec: SpecState | None = None  # None: this request never speculates
    constraint: Constraint | None = None  # the grammar's state; None: unconstrained
    # Prefix-cache salt: KV blocks are shared only between requests with the same salt; None: none.
    prefix_salt: str | None = ""
    # Who the request is for (an API key's id, a client address): batch slots are shared fairly
    # between tenants (scheduler.py). "" is one tenant like any other.
    tenant: str = ""
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose keys and values are in the KV cache; the rest are scheduled in later steps.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the leading full blocks whose tokens are committed (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # set when the engine failed this request alone
    # Buffers filled between two `step()` results.
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
