"""A request's state inside the engine: its tokens, KV blocks, sampling state and counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from specgate.engine.detokenizer import IncrementalDetokenizer
from specgate.engine.outputs import RequestStats, TokenLogprob
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.structured_output.constraint import Constraint
from specgate.engine.vocab import SpecParams


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
    # Its speculation settings (its controller's state is spec_decode's); None: it never speculates.
    spec: SpecParams | None = None
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
    # Parallel sampling (SamplingParams.n > 1): which of the request's sequences this is, and the
    # group it belongs to (None for n == 1).
    index: int = 0
    group: SequenceGroup | None = None
    # The sequence's own key (its proposer's state, the engine's table): the request id for the
    # first sequence, "<request id>/<index>" for the others (filled in by __post_init__).
    seq_id: str = ""

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if not self.seq_id:
            self.seq_id = self.request_id if self.index == 0 else f"{self.request_id}/{self.index}"

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


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """The n sequences of one request with n > 1, sampled from one prompt that is prefilled once.

    The siblings of the first sequence wait in `unforked` (in no queue) until a sequence of the group
    has computed the prompt's first `fork_point` tokens: its full blocks, the last prompt token
    excluded (its logits are what each sequence samples from first). Each sibling then starts on that
    sequence's blocks, shared and ref-counted (block_manager.share): full blocks are never written
    again, so no copy-on-write is needed, and each computes only the prompt's tail (fewer than
    block_size + 1 tokens) into blocks of its own. vLLM v1 shares the same way, through its prefix
    cache; here sharing needs no cache entry, so it holds with prefix caching off or an unsalted
    (private) request too.
    """

    request_id: str
    fork_point: int  # prompt tokens the siblings share (a multiple of the block size; 0: none)
    members: list[Sequence] = field(default_factory=list)  # all n, by index
    unforked: list[Sequence] = field(default_factory=list)  # siblings waiting for a donor

    def __post_init__(self) -> None:
        if self.fork_point < 0:
            raise ValueError(f"fork_point must be >= 0, got {self.fork_point}")

    def donor(self) -> Sequence | None:
        """A running sequence of the group whose leading blocks hold the shared prompt, if any."""
        for seq in self.members:
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= self.fork_point:
                return seq
        return None

    @property
    def active(self) -> bool:
        """Whether a sequence of the group is in the scheduler's queues (waiting or running)."""
        return any(not s.is_finished and s not in self.unforked for s in self.members)
