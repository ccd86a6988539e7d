"""What `Engine.step()` returns: new tokens per request plus the request's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position, best first: (token_id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class RequestStats:
    """Per-request counters; times are `time.monotonic()` seconds."""

    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_steps: int = 0  # forward passes this request took part in
    num_prefill_chunks: int = 0
    num_preemptions: int = 0

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
    finish_reason: str | None  # "stop" | "length" | "abort"
    stats: RequestStats
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
