"""Per-request sampling parameters (OpenAI / vLLM semantics), validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specgate.engine.structured_output.grammar import Grammar

MAX_LOGPROBS = 20
# Temperatures below this sample as greedy: dividing logits by 1e-50 overflows to inf, and the
# distribution it stands for is the argmax's point mass anyway (vLLM uses the same threshold).
SAMPLING_EPS = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator accepts
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
# Sequences one request may sample (parallel sampling): each takes a batch slot and its own KV blocks
# past the shared prompt, so one request cannot fill the batch (the gateway refuses more with a 400).
MAX_N = 16


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    # None: no logprobs; N >= 0: the sampled token's logprob plus the N most likely tokens.
    logprobs: int | None = None
    # OpenAI's logit_bias: token id -> value added to its logit (after penalties, before temperature).
    logit_bias: Mapping[int, float] | None = None
    # The grammar the output must match (a JSON schema, a regex, ...); None: unconstrained.
    grammar: Grammar | None = None
    # Parallel sampling (vLLM's `n`): this many sequences, sampled independently from one prompt that
    # is prefilled once; sequence i draws from seed + i when a seed is set (engine.py).
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()} or None
            for token, value in (self.logit_bias or {}).items():
                if token < 0:
                    raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
                if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError("grammar must be a Grammar")
            # The grammar decides where the output ends: ignoring EOS, or forbidding it before
            # min_tokens, would contradict it wherever the grammar is complete.
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a grammar (structured output)")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with a grammar (structured output)")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
