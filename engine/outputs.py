"""What `Engine.step()` returns: new tokens per request plus the request's counters."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position, best first: (token_id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SpecStats:
    """Per-request speculation counters, named as in vLLM's spec-decode metrics."""

    method: str
    num_drafts: int = 0  # verification steps with at least one drafted token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    per_step_drafted: list[int] = field(default_factory=list)
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_batch_tokens: list[int] = field(default_factory=list)  # tokens in the whole forward pass
    per_step_ms: list[float] = field(default_factory=list)  # that pass's forward time
    # Draft trees: steps whose draft branched, and per step the draft's depth (its length for a chain;
    # per_step_drafted is then the tree's node count and per_step_accepted the accepted depth).
    num_tree_drafts: int = 0
    per_step_depth: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step, the recovered or bonus token included."""
        if not self.num_drafts:
            return 0.0
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_draft_nodes(self) -> float:
        """Drafted tokens (tree nodes) per verification step."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        """Accepted drafts (the accepted path's depth, for a tree) per verification step."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(
        self,
        drafted: int,
        accepted: int,
        batch_tokens: int = 0,
        step_ms: float = 0.0,
        depth: int | None = None,  # a tree's depth; None: a chain of `drafted` tokens
    ) -> None:
        self.num_drafts += 1
        if depth is not None:
            self.num_tree_drafts += 1
        deepest = drafted if depth is None else depth
        self.per_step_depth.append(deepest)
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.num_accepted_tokens_per_pos) < deepest:  # by depth: position i is depth i + 1
            self.num_accepted_tokens_per_pos.extend([0] * (deepest - len(self.num_accepted_tokens_per_pos)))
        for i in range(accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        self.per_step_drafted.append(drafted)
        self.per_step_accepted.append(accepted)
        self.per_step_batch_tokens.append(batch_tokens)
        self.per_step_ms.append(step_ms)


@dataclass(slots=True)
class RequestStats:
    """Per-request counters; times are `time.monotonic()` seconds."""

    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    # Prompt tokens whose keys / values came from the prefix cache (not prefilled by this request).
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_steps: int = 0  # forward passes this request took part in
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    # Drafted tokens a grammar forced (verified like any draft, drafted by no proposer); speculating
    # requests count them in `spec` too.
    num_forced_draft_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # when each output token was emitted
    spec: SpecStats | None = None

    def snapshot(self) -> RequestStats:
        """A copy the caller may keep while the engine goes on updating the original."""
        spec = None
        if self.spec is not None:
            spec = replace(
                self.spec,
                num_accepted_tokens_per_pos=list(self.spec.num_accepted_tokens_per_pos),
                per_step_drafted=list(self.spec.per_step_drafted),
                per_step_accepted=list(self.spec.per_step_accepted),
                per_step_batch_tokens=list(self.spec.per_step_batch_tokens),
                per_step_ms=list(self.spec.per_step_ms),
                per_step_depth=list(self.spec.per_step_depth),
            )
        return replace(self, token_times=list(self.token_times), spec=spec)

    @classmethod
    def merged(cls, stats: Sequence[RequestStats]) -> RequestStats:
        """The counters of one request's n sequences (parallel sampling) as one request's: output
        tokens, preemptions, forced drafts and speculation counters summed (per-step lists one
        sequence after another), the earliest start and first token, the latest last token and
        finish; the prompt and its cached tokens are the first sequence's (it prefilled the prompt).
        `tpot` of the result spreads the time over every sequence's tokens: a throughput, not any
        one choice's time per token."""
        if not stats:
            raise ValueError("merged needs at least one sequence's stats")
        first = stats[0]

        def earliest(values: Iterable[float | None]) -> float | None:
            return min((v for v in values if v is not None), default=None)

        def latest(values: Iterable[float | None]) -> float | None:
            return max((v for v in values if v is not None), default=None)

        spec = None
        specs = [s.spec for s in stats if s.spec is not None]
        if specs:
            per_pos = [0] * max(len(s.num_accepted_tokens_per_pos) for s in specs)
            for s in specs:
                for i, count in enumerate(s.num_accepted_tokens_per_pos):
                    per_pos[i] += count
            spec = SpecStats(
                specs[0].method,
                num_drafts=sum(s.num_drafts for s in specs),
                num_draft_tokens=sum(s.num_draft_tokens for s in specs),
                num_accepted_tokens=sum(s.num_accepted_tokens for s in specs),
                num_accepted_tokens_per_pos=per_pos,
                per_step_drafted=[x for s in specs for x in s.per_step_drafted],
                per_step_accepted=[x for s in specs for x in s.per_step_accepted],
                per_step_batch_tokens=[x for s in specs for x in s.per_step_batch_tokens],
                per_step_ms=[x for s in specs for x in s.per_step_ms],
                num_tree_drafts=sum(s.num_tree_drafts for s in specs),
                per_step_depth=[x for s in specs for x in s.per_step_depth],
            )
        unfinished = any(s.finished_time is None for s in stats)
        finished = None if unfinished else latest(s.finished_time for s in stats)
        return cls(
            arrival_time=min(s.arrival_time for s in stats),
            num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=sum(s.num_output_tokens for s in stats),
            num_cached_tokens=first.num_cached_tokens,
            first_scheduled_time=earliest(s.first_scheduled_time for s in stats),
            first_token_time=earliest(s.first_token_time for s in stats),
            last_token_time=latest(s.last_token_time for s in stats),
            finished_time=finished,
            num_steps=max(s.num_steps for s in stats),
            num_prefill_chunks=first.num_prefill_chunks,
            num_preemptions=sum(s.num_preemptions for s in stats),
            num_forced_draft_tokens=sum(s.num_forced_draft_tokens for s in stats),
            token_times=sorted(t for s in stats for t in s.token_times),
            spec=spec,
        )

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    # Text that became final this step; text that may still turn into a stop string is held back.
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # Why the engine failed this request (finish_reason "error"); the rest of its batch went on.
    error: str | None = None
    # Which of the request's n sequences this is (SamplingParams.n, parallel sampling); each
    # sequence's outputs come on their own, `finished` when that sequence is.
    index: int = 0
