"""A request entering the engine: its inputs checked, its sequence built.

Everything a request could get wrong is refused here, before it holds a KV block or a proposer's
state: an empty prompt, token ids outside the vocabulary, more tokens than the context holds, a seed
torch cannot take. The refusal is a `RequestError` naming the problem; the engine is untouched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from specgate.engine.detokenizer import IncrementalDetokenizer
from specgate.engine.errors import ContextLengthExceededError, RequestError
from specgate.engine.outputs import RequestStats, SpecStats
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.sequence import Sequence
from specgate.engine.vocab import SpecParams


def checked_prompt(
    prompt_token_ids: Seq[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt as a list of ints, once it and the token ids in `params` fit the model."""
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise RequestError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise RequestError(f"stop_token_ids must be in [0, {vocab_size})")
    if len(prompt) + params.max_tokens > max_model_len:
        raise ContextLengthExceededError(
            f"this model's maximum context length is {max_model_len} tokens; the request asks for "
            f"{len(prompt)} prompt + {params.max_tokens} completion tokens"
        )
    return prompt


def request_generator(
    seed: int | None, device: torch.device | str, engine_rng: torch.Generator
) -> torch.Generator:
    """The request's own random stream: from its seed, else from the engine's generator."""
    generator = torch.Generator(device=device)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=engine_rng))
    try:
        generator.manual_seed(seed % 2**64)  # negative seeds as their 64-bit two's complement
    except (RuntimeError, OverflowError) as exc:
        raise RequestError(f"invalid seed {seed}: {exc}") from None
    return generator


def new_sequence(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    spec: SpecParams | None,  # None: this request never speculates
    generator: torch.Generator,
    tokenizer: Any,  # None: token ids only, no text
    prefix_salt: str | None,
    tenant: str = "",
    index: int = 0,  # which of the request's n sequences (parallel sampling)
) -> Sequence:
    detok = None
    if tokenizer is not None:
        detok = IncrementalDetokenizer(tokenizer, prompt, params.stop, params.include_stop_str_in_output)
    stats = RequestStats(arrival_ts=time.monotonic(), num_prompt_tokens=len(prompt))
    if spec is not None:
        stats.spec = SpecStats(spec.method)
    return Sequence(
        request_id=request_id,
        token_ids=list(prompt),  # its own: sequences of one request grow apart
        num_prompt_tokens=len(prompt),
        params=params,
        generator=generator,
        stats=stats,
        detokenizer=detok,
        spec=spec,
        prefix_salt=prefix_salt,
        tenant=tenant,
        index=index,
    )
