"""What `Engine.step()` returns: per sequence and step, what is new (tokens, text, logprobs and the
few facts a client reads while the request runs); once, on its finished output, the request's
counters. A step's output is the size of its news, so a request's outputs add up to the size of the
request, however many steps it takes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from specgate.engine.vocab import SpecStep


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
    num_tree_drafts: int = 0  # steps whose draft branched
    # Every verification step, in order (a tree's: its nodes drafted, its accepted depth).
    steps: list[SpecStep] = field(default_factory=list)

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

    def record(self, step: SpecStep) -> None:
        self.num_drafts += 1
        self.num_tree_drafts += int(step.tree)
        self.num_draft_tokens += step.drafted
        self.num_accepted_tokens += step.accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < step.depth:  # by depth: position i is depth i + 1
            per_pos.extend([0] * (step.depth - len(per_pos)))
        for i in range(step.accepted):
            per_pos[i] += 1
        self.steps.append(step)


@dataclass(slots=True)
class RequestStats:
    """Per-request counters. Times are `time.monotonic()` seconds, named `*_ts` as vLLM's engine
    names its monotonic stamps: the gateway's `arrival_time` / `first_token_time` / `finished_time`
    are unix seconds, and a response's `metrics` turns these into those."""

    arrival_ts: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    # Prompt tokens whose keys / values came from the prefix cache (not prefilled by this request).
    num_cached_tokens: int = 0
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    num_steps: int = 0  # forward passes this request took part in
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    # Drafted tokens a grammar forced (verified like any draft, drafted by no proposer); speculating
    # requests count them in `spec` too.
    num_forced_draft_tokens: int = 0
    spec: SpecStats | None = None

    @classmethod
    def merged(cls, stats: Sequence[RequestStats]) -> RequestStats:
        """The counters of one request's n sequences (parallel sampling) as one request's: output
        tokens, preemptions, forced drafts and speculation counters summed (their verification steps
        one sequence after another), the earliest start and first token, the latest last token and
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
                num_tree_drafts=sum(s.num_tree_drafts for s in specs),
                steps=[step for s in specs for step in s.steps],
            )
        unfinished = any(s.finished_ts is None for s in stats)
        finished = None if unfinished else latest(s.finished_ts for s in stats)
        return cls(
            arrival_ts=min(s.arrival_ts for s in stats),
            num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=sum(s.num_output_tokens for s in stats),
            num_cached_tokens=first.num_cached_tokens,
            scheduled_ts=earliest(s.scheduled_ts for s in stats),
            first_token_ts=earliest(s.first_token_ts for s in stats),
            last_token_ts=latest(s.last_token_ts for s in stats),
            finished_ts=finished,
            num_steps=max(s.num_steps for s in stats),
            num_prefill_chunks=first.num_prefill_chunks,
            num_preemptions=sum(s.num_preemptions for s in stats),
            num_forced_draft_tokens=sum(s.num_forced_draft_tokens for s in stats),
            spec=spec,
        )

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_ts is None else self.scheduled_ts - self.arrival_ts

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_ts is None else self.first_token_ts - self.arrival_ts

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_ts is None or self.last_token_ts is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_ts - self.first_token_ts) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    """One sequence's news from one step (vLLM v1's per-step delta). `stats` is None until the
    sequence's finished output, which carries its counters once: what a client needs while the
    request runs comes with every output, and is small."""

    request_id: str
    new_token_ids: list[int]
    # Text that became final this step; text that may still turn into a stop string is held back.
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats | None = None  # the sequence's counters: on its finished output only
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # Why the engine failed this request (finish_reason "error"); the rest of its batch went on.
    error: str | None = None
    # Which of the request's n sequences this is (SamplingParams.n, parallel sampling); each
    # sequence's outputs come on their own, `finished` when that sequence is.
    index: int = 0
    # Prompt tokens whose keys / values came from the prefix cache: known once the prompt is
    # scheduled, so that a request cancelled before it finishes still reports them.
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if (self.stats is not None) != self.finished:
            raise ValueError("a sequence's counters come with its finished output, and only with it")
        if self.index < 0 or self.num_cached_tokens < 0:
            raise ValueError("index and num_cached_tokens must be non-negative")
